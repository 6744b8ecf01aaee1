"""Checks on gathered metadata before planning: ranks must agree on what they share."""

from __future__ import annotations

from snapstate.errors import InconsistentStateError
from snapstate.planning.holdings import Holdings

__all__ = ["InconsistentStateError", "check_consistent"]


def check_consistent(holdings: Holdings) -> None:
    """Raise naming the shared keys whose dtype, shape or placement differ between ranks."""
    if holdings.problems:
        raise InconsistentStateError(
            "ranks disagree on shared state:\n  " + "\n  ".join(holdings.problems[:20])
        )

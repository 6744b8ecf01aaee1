"""Retention policy as a pure function: which committed steps may be deleted."""

from __future__ import annotations


def steps_to_delete(
    committed: list[int], keep_last: int | None, keep_every: int | None
) -> list[int]:
    """Steps outside the policy. The newest committed step is always kept."""
    if keep_last is None or not committed:
        return []
    ordered = sorted(committed)
    keep = set(ordered[-keep_last:])
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]

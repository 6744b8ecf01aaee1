"""Checks on gathered metadata before planning: ranks must agree on what they share."""

from __future__ import annotations

from snapstate.errors import InconsistentStateError
from snapstate.planning.items import ItemMeta, Placement

__all__ = ["InconsistentStateError", "check_consistent"]


def check_consistent(all_metas: list[list[ItemMeta]]) -> None:
    seen: dict[str, tuple[int, ItemMeta]] = {}
    problems: list[str] = []
    for rank, metas in enumerate(all_metas):
        for meta in metas:
            if meta.placement is Placement.RANK_LOCAL:
                continue
            if meta.key not in seen:
                seen[meta.key] = (rank, meta)
                continue
            first_rank, first = seen[meta.key]
            if (first.dtype, first.shape, first.placement) != (
                meta.dtype,
                meta.shape,
                meta.placement,
            ):
                problems.append(
                    f"{meta.key!r}: rank {first_rank} has {first.placement.value} {first.dtype}{list(first.shape)}, "
                    f"rank {rank} has {meta.placement.value} {meta.dtype}{list(meta.shape)}"
                )
    if problems:
        raise InconsistentStateError(
            "ranks disagree on shared state:\n  " + "\n  ".join(problems[:20])
        )

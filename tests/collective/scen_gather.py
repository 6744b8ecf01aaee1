"""Rank side of the gather test: objects below, at and above the inline size, on every rank."""

from __future__ import annotations

from typing import Any

from snapstate.collective.torch_dist import INLINE_BYTES, TorchDistCoordinator


def gather(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    coord = TorchDistCoordinator.for_group(None)
    cases = {
        "small": ("ok", rank),
        "at_inline": "x" * (INLINE_BYTES - 40),  # pickles to about INLINE_BYTES
        "one_long": "y" * (10 * INLINE_BYTES if rank == 1 else 3),  # only rank 1 overflows
        "all_long": list(range(rank * 1000, rank * 1000 + 2000)),
    }
    out: dict[str, Any] = {}
    for name, obj in cases.items():
        bounded = coord.all_gather(obj, timeout=30)
        unbounded = coord.all_gather(obj)
        out[name] = bounded == unbounded and bounded[rank] == obj
        out[name + "_sizes"] = [len(o) if isinstance(o, str | list) else o for o in bounded]
    return out

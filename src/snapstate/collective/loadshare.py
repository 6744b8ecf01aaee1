"""Read-once-and-send, the part that talks to other ranks: failing them together, and moving
each batch of shared bytes from the rank that read it to the ranks that need it.

The reading side (what each rank needs, who reads it, the checks) is ``engine/sharedread.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from snapstate.collective.coordinator import Coordinator, gather_or_raise
from snapstate.planning.readplan import Batch, ReadPlan


def fail_together(coord: Coordinator, exc: BaseException) -> None:
    """Join the first gather of the others with an error, so they raise instead of waiting."""

    def fail() -> None:
        raise exc

    gather_or_raise(coord, fail)


def send_batches(
    coord: Coordinator,
    plan: ReadPlan,
    buffer_for: Callable[[Batch, bool], torch.Tensor],
    received: Callable[[Batch, torch.Tensor], None],
) -> int:
    """Move every batch this rank reads or receives: a broadcast when every other rank needs
    it, point-to-point otherwise. ``buffer_for(batch, sending)`` gives the bytes to send or
    the buffer to receive into; ``received`` takes each batch that came in. Returns the bytes
    received."""
    import torch.distributed as dist

    group = getattr(coord, "group", None)
    everyone = coord.world_size - 1
    got = 0
    for tag, batch in enumerate(plan.batches):
        me = coord.rank
        if me != batch.reader and me not in batch.receivers:
            continue  # point-to-point between others (a broadcast involves every rank)
        buffer = buffer_for(batch, me == batch.reader)
        if len(batch.receivers) == everyone:
            dist.broadcast(buffer, src=_global(batch.reader, group), group=group)
        elif me == batch.reader:
            for w in [
                dist.isend(buffer, _global(r, group), group=group, tag=tag) for r in batch.receivers
            ]:
                if w is not None:
                    w.wait()
        else:
            dist.recv(buffer, _global(batch.reader, group), group=group, tag=tag)
        if me != batch.reader:
            got += batch.nbytes
            received(batch, buffer)
    return got


def _global(rank: int, group: Any) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)

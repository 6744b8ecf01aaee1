"""Read-once-and-send, the part that talks to other ranks: failing them together, and moving
each batch of shared bytes from the rank that read it to the ranks that need it.

The reading side (what each rank needs, who reads it, the checks) is ``engine/sharedread.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from snapstate.collective.coordinator import Coordinator, gather_or_raise
from snapstate.collective.torch_dist import wait_work
from snapstate.errors import CheckpointTimeoutError
from snapstate.planning.readplan import Batch, ReadPlan


def fail_together(coord: Coordinator, exc: BaseException, timeout: float | None = None) -> None:
    """Join the first gather of the others with an error, so they raise instead of waiting."""

    def fail() -> None:
        raise exc

    gather_or_raise(coord, fail, timeout)


def send_batches(
    coord: Coordinator,
    plan: ReadPlan,
    buffer_for: Callable[[Batch, bool], torch.Tensor],
    received: Callable[[Batch, torch.Tensor], None],
    timeout: float | None = None,
) -> int:
    """Move every batch this rank reads or receives: a broadcast when every other rank needs
    it, point-to-point otherwise. ``buffer_for(batch, sending)`` gives the bytes to send or
    the buffer to receive into; ``received`` takes each batch that came in. Returns the bytes
    received. With ``timeout``, a peer that does not take part within it (stopped, hung) is a
    CheckpointTimeoutError, not the process group's own timeout."""
    import torch.distributed as dist

    group = getattr(coord, "group", None)
    everyone = coord.world_size - 1
    deadline = None if timeout is None else time.monotonic() + timeout
    got = 0
    for tag, batch in enumerate(plan.batches):
        me = coord.rank
        if me != batch.reader and me not in batch.receivers:
            continue  # point-to-point between others (a broadcast involves every rank)
        buffer = buffer_for(batch, me == batch.reader)
        if len(batch.receivers) == everyone:
            works = [dist.broadcast(buffer, _global(batch.reader, group), group, async_op=True)]
        elif me == batch.reader:
            works = [dist.isend(buffer, _global(r, group), group, tag) for r in batch.receivers]
        else:
            works = [dist.irecv(buffer, _global(batch.reader, group), group, tag)]
        for work in works:
            _wait(work, deadline, timeout)
        if me != batch.reader:
            got += batch.nbytes
            received(batch, buffer)
    return got


def _wait(work: Any, deadline: float | None, timeout: float | None) -> None:
    if work is None:  # a send to this rank itself
        return
    try:
        wait_work(work, deadline)
    except RuntimeError as exc:  # gloo's timeout; torch's DistError derives from it too
        if deadline is None:
            raise
        raise CheckpointTimeoutError(
            f"a rank did not send or receive its share of the load within {timeout:g}s "
            "(stopped, hung or dead)"
        ) from exc


def _global(rank: int, group: Any) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)

"""What the trainer integrations share: a checkpoint read back as plain containers, RNG snapshots."""

from __future__ import annotations

import os
from typing import Any

from snapstate.state.rng import RNGState


def read_state(path: str | os.PathLike[str], rank: int | None = None) -> Any:
    """The checkpoint as plain nested containers, with ``rank``'s rank-local values.

    The one place the integrations read a whole checkpoint: not a collective, every rank reads.
    """
    import snapstate as ss

    return ss.read_state(path, rank=rank)


def is_checkpoint_dir(path: Any) -> bool:
    """True for a directory holding a committed snapstate checkpoint (its manifest)."""
    try:
        return os.path.isfile(os.path.join(os.fspath(path), "manifest.json"))
    except TypeError:  # a file object, or anything else that is not a path
        return False


def rng_snapshot() -> dict[str, Any]:
    """Every global generator of this process (python, numpy, torch CPU and CUDA), now."""
    return RNGState().state_dict()


def rng_restore(snapshot: dict[str, Any]) -> None:
    RNGState().load_state_dict(snapshot)


def dist_rank() -> int:
    """This process's rank in torch.distributed, 0 when it is not initialized."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agreed(value: str) -> str:
    """Rank 0's ``value`` on every rank (the ranks must write the same directory)."""
    if dist_world() == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])

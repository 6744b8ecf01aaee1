"""Tensor placement: what part of a tensor this rank holds (plain tensors are replicated)."""

from __future__ import annotations

import torch

from snapstate.format.dtypes import dtype_name, itemsize
from snapstate.planning.items import Box, ItemMeta, Placement
from snapstate.planning.reshard import local_slices


def is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_box(t: torch.Tensor) -> Box:
    """The box of the global tensor that this rank's local data covers."""
    if not is_dtensor(t):
        return Box.full(tuple(t.shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return Box(tuple(offset), tuple(shape))


def local_data(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def item_meta(key: str, t: torch.Tensor, rank_local: bool) -> ItemMeta:
    name = dtype_name(t.dtype)
    shape = tuple(t.shape)
    if rank_local:
        return ItemMeta(key, name, shape, itemsize(t.dtype), Placement.RANK_LOCAL, (Box.full(shape),))
    if is_dtensor(t):
        return ItemMeta(key, name, shape, itemsize(t.dtype), Placement.SHARD, (local_box(t),))
    return ItemMeta(key, name, shape, itemsize(t.dtype), Placement.REPLICATE, (Box.full(shape),))


def source_view(t: torch.Tensor, box: Box) -> torch.Tensor:
    """This rank's data for ``box`` (which must lie inside what the rank holds)."""
    return local_data(t)[local_slices(local_box(t), box)]

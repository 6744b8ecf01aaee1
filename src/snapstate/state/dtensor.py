"""Tensor placement: what part of a tensor this rank holds (plain tensors are replicated).

A DTensor (``Shard``/``Replicate`` placements on 1-D or N-D meshes, uneven shards included,
as FSDP2's ``fully_shard`` makes them) holds one box of the global tensor on each rank;
ranks that hold the same box are replicas of it. ``Partial`` values are not the tensor yet
(a pending reduction), and strided shards are not a box, so both are refused by name.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from snapstate.format.dtypes import dtype_name, itemsize
from snapstate.planning.items import Box, ItemMeta, Placement
from snapstate.planning.reshard import local_slices


@functools.cache
def _dtensor_class() -> type | None:
    # looked up once: the import statement costs ~80 us a call once torch.distributed is up,
    # 25 ms per load of a 300-tensor state
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    # Until someone imports torch.distributed.tensor no DTensor can exist: importing it here
    # would cost the first save ~2 s (TensorFlow and Chainer runs never import it otherwise).
    if "torch.distributed.tensor" not in sys.modules:
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def check_placements(key: str, t: torch.Tensor) -> None:
    """Refuse placements whose local data is not one box of the global tensor."""
    for p in t.placements:  # type: ignore[attr-defined]
        kind = type(p).__name__
        if p.is_partial():
            raise TypeError(
                f"cannot checkpoint the DTensor at key {key!r}: placement {p} holds partial values; reduce it (redistribute to Replicate or Shard) first"
            )
        if kind == "_StridedShard":
            raise TypeError(
                f"cannot checkpoint the DTensor at key {key!r}: strided shards ({p}) are not supported; redistribute to Shard or Replicate first"
            )


def local_box(t: torch.Tensor) -> Box:
    """The box of the global tensor that this rank's local data covers."""
    if not is_dtensor(t):
        return Box.full(tuple(t.shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    return Box(tuple(offset), tuple(shape))


def local_data(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def item_meta(key: str, t: torch.Tensor, rank_local: bool, from_rank0: bool = False) -> ItemMeta:
    name = dtype_name(t.dtype)
    shape = tuple(t.shape)
    if rank_local:
        return ItemMeta(
            key, name, shape, itemsize(t.dtype), Placement.RANK_LOCAL, (Box.full(shape),)
        )
    if is_dtensor(t):
        check_placements(key, t)
        return ItemMeta(key, name, shape, itemsize(t.dtype), Placement.SHARD, (local_box(t),))
    return ItemMeta(
        key, name, shape, itemsize(t.dtype), Placement.REPLICATE, (Box.full(shape),), from_rank0
    )


def source_view(t: torch.Tensor, box: Box) -> torch.Tensor:
    """This rank's data for ``box`` (which must lie inside what the rank holds)."""
    return local_data(t)[local_slices(local_box(t), box)]


def optimizer_templates(optimizer: Any, path: str) -> dict[str, torch.Tensor]:
    """For a torch optimizer at ``path``: ``path/state/<i>`` -> the i-th parameter.

    A fresh optimizer has no state yet; when a checkpoint fills it, each per-parameter
    tensor shaped like its parameter is allocated like the parameter (a DTensor with the
    same mesh and placements under FSDP2), so that each rank holds and reads only its shard.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return {}
    prefix = f"{path}/state" if path else "state"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {f"{prefix}/{i}": p for i, p in enumerate(params)}


def allocate_like(
    template: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """An uninitialised tensor placed like ``template`` (a DTensor), or None to allocate plainly."""
    if not is_dtensor(template) or tuple(template.shape) != tuple(shape):
        return None
    with torch.no_grad():
        return torch.empty_like(template.detach(), dtype=dtype)

"""Rank side of the grid-manifest test: replicated and sharded tensors of many chunks saved
on 2 ranks (a version 5 manifest), loaded back on 2 ranks, bitwise."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import snapstate as ss
from snapstate.format import grid
from support.bits import same_bits

from .common import pattern

# 512-byte chunks: the replicated `w` is spread over both ranks, the column shards of `s` are cut
# in rows: a grid of both dimensions whose cells alternate between the ranks' files
OPTIONS = ss.SaveOptions(plan=ss.PlanOptions(chunk_bytes=512), block_bytes=256)


def full() -> dict[str, torch.Tensor]:
    return {"w": pattern((64, 32), 1), "s": pattern((96, 16), 2, torch.float64)}


def make(values: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,))
    tensors = full() if values else {k: torch.zeros_like(t) for k, t in full().items()}
    return {"w": tensors["w"], "s": distribute_tensor(tensors["s"], mesh, [Shard(1)])}


def save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    grid.GRID_MIN_MANIFEST_CHUNKS = 1  # grids in a small manifest (this forked rank only)
    ss.save(make(values=True), args["path"], options=OPTIONS)
    target = make(values=False)
    ss.load(target, args["path"])
    s = target["s"]
    assert isinstance(s, DTensor)
    return {"same": same_bits(target["w"], full()["w"]) and same_bits(s.full_tensor(), full()["s"])}

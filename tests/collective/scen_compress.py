"""Rank side of the compression tests: save compressed under one layout, load under another."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import snapstate as ss
from support.bits import same_bits

from .common import pattern

SHAPES = {"w": ((240, 64), torch.float32), "e": ((96, 80), torch.bfloat16)}


def full(key: str) -> torch.Tensor:
    shape, dtype = SHAPES[key]
    return pattern(shape, sorted(SHAPES).index(key), dtype)


def make(world: int, layout: dict[str, str], values: bool) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for key, spec in layout.items():
        source = full(key) if values else torch.zeros(SHAPES[key][0], dtype=SHAPES[key][1])
        placement = Replicate() if spec == "R" else Shard(int(spec[1:]))
        out[key] = distribute_tensor(source, mesh, [placement])
    return out


def save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    state = {"params": make(world, args["layout"], values=True)}
    ss.save(state, args["path"], options=ss.SaveOptions(compression="zstd"))
    return {}


def load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for read_once in (False, True):
        params = make(world, args["layout"], values=False)
        result = ss.load({"params": params}, args["path"], read_once=read_once)
        expected = make(world, args["layout"], values=True)
        out[f"read_once={read_once}"] = {
            "equal": {k: same_bits(params[k].to_local(), expected[k].to_local()) for k in params},
            "bytes_read": result.bytes_read,
        }
        dist.barrier()
    return out

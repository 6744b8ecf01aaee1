"""Rank side of the incremental tests: a manager saves steps incrementally on N ranks (a frozen
sharded tensor, trained ones that change), then steps are loaded under another layout."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import snapstate as ss
from support.bits import same_bits

from .common import pattern

SHAPES = {
    "frozen": ((240, 64), torch.float32),  # never changes: referenced after the first step
    "emb": ((96, 80), torch.bfloat16),  # trained
    "head": ((48, 32), torch.float32),  # trained
}


def full(key: str, step: int) -> torch.Tensor:
    shape, dtype = SHAPES[key]
    salt = sorted(SHAPES).index(key) + (0 if key == "frozen" else 10 * step)
    return pattern(shape, salt, dtype)


def make(world: int, layout: dict[str, str], step: int | None) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for key, spec in layout.items():
        shape, dtype = SHAPES[key]
        source = full(key, step) if step is not None else torch.zeros(shape, dtype=dtype)
        placement = Replicate() if spec == "R" else Shard(int(spec[1:]))
        out[key] = distribute_tensor(source, mesh, [placement])
    return out


def save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    written = {}
    with ss.CheckpointManager(args["root"], incremental=True, async_save=args["async"]) as mgr:
        for step in args["steps"]:
            mgr.save(step, {"params": make(world, args["layout"], step), "step": step})
            result = mgr.wait()
            written[step] = result.bytes_written if result is not None else None
    return {"written": written}


def load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for step in args["steps"]:
        for read_once in (False, True):
            params = make(world, args["layout"], None)
            state = {"params": params, "step": -1}
            ss.load(state, f"{args['root']}/step-{step:09d}", read_once=read_once)
            expected = make(world, args["layout"], step)
            equal = {k: same_bits(params[k].to_local(), expected[k].to_local()) for k in params}
            out[f"{step} read_once={read_once}"] = {"equal": equal, "step": state["step"]}
            dist.barrier()
    return out

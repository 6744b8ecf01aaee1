"""Rank side of the DTensor tests: save under one placement and mesh, load under another."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import snapstate as ss
from snapstate.state.dtensor import local_box
from support.bits import same_bits

from .common import pattern

BLOCK = 64  # tiny checksum blocks: reads of a few rows stay a few rows
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "a": ((10, 6), torch.float32),
    "u": ((7, 5), torch.float32),  # uneven on 2, 3 and 4 ranks
    "r": ((4, 4), torch.bfloat16),
    "c": ((6, 9), torch.float64),
    "t": ((3,), torch.int64),  # fewer rows than ranks: some hold nothing
}


def full(key: str) -> torch.Tensor:
    shape, dtype = SPECS[key]
    salt = sorted(SPECS).index(key)
    return (
        pattern(shape, salt, torch.float64).mul(1000).to(dtype)
        if dtype == torch.int64
        else pattern(shape, salt, dtype)
    )


def placements(spec: list[str]) -> list[Any]:
    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


def make(mesh_shape: list[int], layout: dict[str, list[str]], values: bool) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    out = {}
    for key, spec in layout.items():
        source = full(key) if values else torch.full(SPECS[key][0], -7).to(SPECS[key][1])
        out[key] = distribute_tensor(source, mesh, placements(spec))
    return out


def save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    state = {"params": make(args["mesh"], args["layout"], values=True), "note": "dtensor"}
    result = ss.save(state, args["path"], options=ss.SaveOptions(block_bytes=BLOCK))
    return {
        "bytes_written": result.bytes_written,
        "replica_check_s": result.timings["replica_check_s"],
    }


def load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    manifest = ss.inspect(args["path"])
    for read_once in (False, True):
        params = make(args["mesh"], args["layout"], values=False)
        result = ss.load({"params": params}, args["path"], read_once=read_once)
        expected = make(args["mesh"], args["layout"], values=True)
        out[f"read_once={read_once}"] = {
            "equal": {k: same_bits(params[k].to_local(), expected[k].to_local()) for k in params},
            "placements": {k: [str(p) for p in params[k].placements] for k in params},
            "bytes_read": result.bytes_read,
            "bytes_received": result.bytes_received,
        }
        dist.barrier()
    out["need"] = sum(
        needed_bytes(manifest, k, local_box(t))
        for k, t in make(args["mesh"], args["layout"], values=False).items()
    )
    out["local_bytes"] = sum(t.to_local().numel() * t.element_size() for t in params.values())
    return out


def needed_bytes(manifest: ss.Manifest, key: str, box: Any) -> int:
    """Bytes of the rows of each stored chunk that meet ``box``, widened to whole blocks."""
    rec = manifest.tensors[f"params/{key}"]
    itemsize = rec.nbytes // max(math.prod(rec.shape), 1)
    total = 0
    for c in rec.chunks:
        lo = [max(a, b) for a, b in zip(c.offsets, box.offsets)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(c.offsets, c.sizes, box.offsets, box.sizes)]
        if any(h <= lo_ for lo_, h in zip(lo, hi)) or box.numel == 0:
            continue
        row = math.prod(c.sizes[1:]) * itemsize
        start, end = (lo[0] - c.offsets[0]) * row, (hi[0] - c.offsets[0]) * row
        start, end = start // BLOCK * BLOCK, min(-(-end // BLOCK) * BLOCK, c.end - c.start)
        total += end - start
    return total

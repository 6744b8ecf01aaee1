"""Rank side of the FSDP2 tests: fully_shard model + Adam, saved on N ranks, loaded on M."""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import snapstate as ss
from support.bits import same_bits

from .common import flat_tensors


def model_and_optimizer(world: int | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # 7 and 3 rows: uneven shards
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    if world is not None:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 5, generator=g)).square().mean().backward()
    opt.step()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = flat_tensors({"model": model.state_dict(), "optim": opt.state_dict()["state"]})
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).contiguous()
        for k, v in tensors.items()
    }


def save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    model, opt = model_and_optimizer(world)
    for i in range(2):
        step(model, opt, 10 * i + rank)
    result = ss.save(
        {"model": model, "optim": opt}, args["path"], options=ss.SaveOptions(block_bytes=64)
    )
    reference = full_state(model, opt)
    if rank == 0:
        save_file(reference, args["reference"])
    return {
        "bytes_written": result.bytes_written,
        "state_bytes": sum(t.numel() * t.element_size() for t in reference.values()),
    }


def load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    model, opt = model_and_optimizer(world)
    assert not opt.state  # a fresh optimizer: its state is created by the load
    result = ss.load({"model": model, "optim": opt}, args["path"], read_once=True)
    local = flat_tensors({"model": model.state_dict(), "optim": opt.state_dict()["state"]}).values()
    need = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in local)
    got, reference = full_state(model, opt), load_file(args["reference"])
    equal = sorted(got) == sorted(reference) and all(
        same_bits(got[k], reference[k]) for k in reference
    )
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]
    weight = model.state_dict()["0.weight"]
    before = weight.full_tensor().clone()
    step(model, opt, 99 + rank)  # training goes on from the loaded state
    return {
        "equal": equal,
        "optimizer_state_sharded": isinstance(exp_avg, DTensor)
        and exp_avg.placements == weight.placements
        and exp_avg.to_local().shape == weight.to_local().shape,
        "trains": not same_bits(model.state_dict()["0.weight"].full_tensor(), before),
        "bytes_read": result.bytes_read,
        "need": need,  # the bytes of this rank's shards (and of the replicated step counters)
        "tensors": len(local),
    }

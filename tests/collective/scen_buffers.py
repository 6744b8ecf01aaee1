"""Rank side of the BatchNorm test: DDP buffers differ between steps, rank 0's copy is saved."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import snapstate as ss


def save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = DDP(model)
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)  # each rank its own batch
        opt.zero_grad()
        ddp(torch.randn(32, 8, generator=g)).sum().backward()
        opt.step()
    result = ss.save({"model": model, "optim": opt}, args["path"])
    return {
        "running_mean": model[1].running_mean.tolist(),
        "weight": model[0].weight.flatten().tolist(),
        "bytes_written": result.bytes_written,
    }

"""Rank side of the resume tests: DDP training with a DistributedSampler and a StatefulDataLoader,
and an elastic data order (ElasticSampler) across a change of world size."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import snapstate as ss
from snapstate.data import ElasticSampler

from .common import digest, flat_tensors

SAMPLES, FEATURES, BATCH = 96, 16, 4  # 12 steps an epoch on 2 ranks


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, x @ torch.randn(FEATURES, 1, generator=g))


def setup(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=True, seed=5)
    # The loader's own generator (reseeded each epoch) keeps the global RNG out of its base seed.
    loader = StatefulDataLoader(
        dataset(), batch_size=BATCH, sampler=sampler, generator=torch.Generator()
    )
    torch.manual_seed(100 + rank)  # dropout differs per rank, as it does in real jobs
    return {
        "model": model,
        "optim": opt,
        "loader": ss.RankLocal(loader),
        "rng": ss.RNGState(),
        "step": 0,
        "epoch": 0,
    }


def train(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    state = setup(rank, world)
    ddp = DDP(state["model"])
    loader: StatefulDataLoader = state["loader"].value
    out = Path(args["out"])
    mgr = ss.CheckpointManager(args["root"], async_save=True, timeout=60)
    resumed = args.get("resume", False)
    if resumed:
        # a negative control: leave this part of the state out of the restore
        skip = args.get("skip")
        target = {k: v for k, v in state.items() if k != skip}
        assert mgr.restore(target) == args["save_at"]
        state.update({k: target[k] for k in ("step", "epoch")})
    losses = open(out / f"losses-{rank}.txt", "a")
    while state["step"] < args["steps"]:
        loader.sampler.set_epoch(state["epoch"])  # type: ignore[attr-defined]
        if not resumed:
            loader.generator.manual_seed(7 * state["epoch"])  # type: ignore[union-attr]
        resumed = False  # a restored loader continues its epoch; the next ones start afresh
        for x, y in loader:
            state["optim"].zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            state["optim"].step()
            state["step"] += 1
            losses.write(f"{state['step']} {loss.item().hex()}\n")
            losses.flush()
            if state["step"] == args.get("save_at"):
                mgr.save(state["step"], state)
            if state["step"] == args.get("kill_at"):
                mgr.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if state["step"] == args["steps"]:
                break
        else:
            state["epoch"] += 1
    mgr.close()
    final = {k: digest(v) for k, v in state["model"].state_dict().items()}
    final.update(
        {
            f"optim/{k}": digest(v)
            for k, v in flat_tensors(state["optim"].state_dict()["state"]).items()
        }
    )
    return {"params": final, "rng": digest(torch.get_rng_state())}


def elastic(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Take batches of one epoch from an ElasticSampler; checkpoint, go on, and get killed (or resume)."""
    sampler = ElasticSampler(SAMPLES, seed=11)
    loader = DataLoader(range(SAMPLES), batch_size=BATCH, sampler=sampler)
    path = Path(args["path"])
    if args.get("resume"):
        ss.load({"sampler": sampler}, path)
    seen: list[int] = []
    for i, batch in enumerate(loader):
        seen.extend(batch.tolist())
        if i + 1 == args.get("save_after"):
            ss.save({"sampler": sampler}, path)
            # what the checkpoint covers
            (Path(args["out"]) / f"seen-{rank}.json").write_text(json.dumps(seen))
        if i + 1 == args.get("kill_after"):
            os.kill(os.getpid(), signal.SIGKILL)
    return {"seen": seen, "state": sampler.state_dict()}

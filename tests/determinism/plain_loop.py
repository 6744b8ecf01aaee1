"""The loop users write, with async checkpoints; run as its own process by test_plain_loop.py.

``for epoch in range(start, EPOCHS): for x, y in loader:`` with dropout, random augmentation
inside the dataset's ``__getitem__`` (torch, numpy and python ``random``), AdamW and
``CheckpointManager(async_save=True)`` saving every 4 steps. Nothing is reseeded: the loader
either has its own generator, seeded once, or none. Losses are logged as ``float.hex``.

Usage: ``python plain_loop.py --root CKPT --out DIR [--generator] [--workers W] [--wrap]
[--kill-at S] [--resume] [--skip rng|loader] [--no-save]``.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import snapstate as ss
from snapstate.data import WorkerRNG

SAMPLES, FEATURES, BATCH, EPOCHS, EVERY = 48, 8, 4, 4, 4  # 12 steps an epoch, 48 in all


class Augmented(torch.utils.data.Dataset):
    """Fixed data; every ``__getitem__`` draws noise from torch, numpy and python ``random``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = self.x @ torch.randn(FEATURES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(FEATURES) * 0.05 + float(np.random.standard_normal()) * 0.01
        return self.x[i] * (1.0 + 0.1 * random.random()) + noise, self.y[i]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--generator", action="store_true", help="the loader has its own generator")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--wrap", action="store_true", help="dataset in snapstate.data.WorkerRNG")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--skip", choices=["rng", "loader"], default=None)
    p.add_argument("--no-save", action="store_true")
    return p.parse_args()


def make_state(args: argparse.Namespace) -> dict[str, Any]:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset: Any = WorkerRNG(Augmented()) if args.wrap else Augmented()
    loader = StatefulDataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(7) if args.generator else None,
    )
    return {
        "model": model,
        "optim": optim,
        "loader": loader,
        "rng": ss.RNGState(),
        "epoch": 0,
        "step": 0,
    }


def step_once(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> float:
    state["optim"].zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(state["model"](x), y)
    loss.backward()
    state["optim"].step()
    state["step"] += 1
    return float(loss.item())


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = make_state(args)
    with (
        ss.CheckpointManager(args.root, keep_last=3, async_save=True) as mgr,
        open(out / "losses.txt", "a") as log,
    ):
        if args.resume and args.skip is None:
            mgr.restore(state)  # the README's recipe: plain values come back in the dict
        elif args.resume:
            target = {k: v for k, v in state.items() if k != args.skip}
            mgr.restore(target)
            state["epoch"], state["step"] = target["epoch"], target["step"]
        state["model"].train()
        for epoch in range(state["epoch"], EPOCHS):
            state["epoch"] = epoch
            for x, y in state["loader"]:
                loss = step_once(state, x, y)
                log.write(f"{state['step']} {loss.hex()}\n")
                log.flush()
                if not args.no_save and state["step"] % EVERY == 0:
                    mgr.save(state["step"], state)
                if state["step"] == args.kill_at:
                    mgr.wait()
                    # written whole, then renamed: the test reads it the moment it appears
                    (out / "ready.tmp").write_text(str(mgr.latest_step()))
                    (out / "ready.tmp").replace(out / "ready")
                    time.sleep(600)  # SIGKILLed here
                    raise SystemExit("expected to be killed")
    torch.save(
        {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()},
        out / "final.pt",
    )


if __name__ == "__main__":
    run(parse_args())

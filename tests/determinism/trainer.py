"""A small training run with async checkpoints, run as its own process by the determinism tests.

Every source of randomness a real run has is here: dropout (torch's global generator), numpy
and python ``random`` noise in the input pipeline, and a shuffled StatefulDataLoader with its
own seeded generator. Losses are logged as ``float.hex`` (exact), one line per step, flushed
so that lines written before a SIGKILL survive it.

Usage: ``python trainer.py --root CKPT --out DIR [--steps N --every K --kill-at S --workers W
--resume --skip rng|loader --no-save --no-reseed]``.
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

LOSSES = "losses.txt"
FINAL = "final.pt"
READY = "ready"
SAMPLES, FEATURES, BATCH = 96, 16, 8  # 12 batches an epoch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", required=True, help="CheckpointManager root")
    p.add_argument("--out", required=True, help="directory for losses, final state and markers")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="checkpoint every K steps")
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="after this step: wait for the pending checkpoint, mark ready, sleep",
    )
    p.add_argument("--workers", type=int, default=0, help="data-loader worker processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="restore the manager's latest step first")
    p.add_argument(
        "--skip",
        choices=["rng", "loader"],
        default=None,
        help="leave this part out of the restore (negative control)",
    )
    p.add_argument(
        "--no-save", action="store_true", help="write no checkpoints (negative controls)"
    )
    p.add_argument(
        "--no-reseed", action="store_true", help="do not reseed the loader each epoch (see Batches)"
    )
    return p.parse_args(argv)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)  # fixed data, independent of the run's seed
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def make_state(args: argparse.Namespace) -> dict[str, Any]:
    seed_everything(args.seed)
    model = nn.Sequential(
        nn.Linear(FEATURES, 32),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(32, 1),
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.5)
    loader = StatefulDataLoader(
        make_dataset(),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
        num_workers=args.workers,
    )
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "loader": loader,
        "rng": ss.RNGState(),
        "step": 0,
        "epoch": 0,
    }


def augment(x: torch.Tensor) -> torch.Tensor:
    """Input noise from numpy and python ``random``, so RNGState must restore both."""
    noise = torch.from_numpy(np.random.standard_normal(tuple(x.shape)).astype(np.float32))
    return x * (1.0 + 0.05 * random.random()) + 0.01 * noise


def train_step(state: dict[str, Any], batch: list[torch.Tensor]) -> float:
    model, optim, sched = state["model"], state["optim"], state["sched"]
    x, y = batch
    model.train()
    optim.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(augment(x)), y)
    loss.backward()
    optim.step()
    sched.step()
    state["step"] += 1
    return float(loss.item())


def restore(mgr: ss.CheckpointManager, state: dict[str, Any], skip: str | None) -> int:
    target = {k: v for k, v in state.items() if k != skip}
    step = mgr.restore(target)
    if step is None:
        raise SystemExit(f"nothing to resume from in {mgr.root}")
    # Plain values are replaced in the target dict, not in ``state``.
    state["step"], state["epoch"] = target["step"], target["epoch"]
    return step


def write_final(state: dict[str, Any], path: Path) -> None:
    final = {name: state[name].state_dict() for name in ("model", "optim", "sched")}
    rng = ss.RNGState().state_dict()
    keys = rng["numpy"]["keys"].astype(np.int64)
    rng["numpy"]["keys"] = torch.from_numpy(keys)  # so that weights_only=True loads it
    final["rng"] = rng
    final["step"], final["epoch"] = state["step"], state["epoch"]
    torch.save(final, path)


class Batches:
    """Endless batches, one epoch after another; epochs are counted in the state.

    By default each epoch reseeds the loader's generator from (seed, epoch), a pattern some
    users write; it is not needed: snapstate saves the generator's current state, so
    ``reseed=False`` resumes bitwise too (test_resume.py and test_plain_loop.py check both).
    """

    def __init__(self, state: dict[str, Any], seed: int, reseed: bool, resumed: bool) -> None:
        self.state, self.seed, self.reseed = state, seed, reseed
        # A restored loader's first iter() continues the epoch it was saved in.
        self.it = iter(state["loader"]) if resumed else None

    def next(self) -> list[torch.Tensor]:
        while True:
            if self.it is not None:
                try:
                    return next(self.it)
                except StopIteration:
                    pass
            self.state["epoch"] += 1
            loader = self.state["loader"]
            if self.reseed:
                loader.generator.manual_seed(self.seed * 1_000_003 + self.state["epoch"])
            self.it = iter(loader)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = make_state(args)
    with (
        ss.CheckpointManager(args.root, keep_last=3, async_save=True) as mgr,
        open(out / LOSSES, "a") as log,
    ):
        if args.resume:
            restore(mgr, state, args.skip)
        stream = Batches(state, args.seed, reseed=not args.no_reseed, resumed=args.resume)
        while state["step"] < args.steps:
            loss = train_step(state, stream.next())
            log.write(f"{state['step']} {loss.hex()}\n")
            log.flush()  # in the OS before a SIGKILL can land
            if not args.no_save and state["step"] % args.every == 0:
                mgr.save(state["step"], state)
            if state["step"] == args.kill_at:
                mgr.wait()  # the last checkpoint is committed before we say we are ready
                # written whole, then renamed: the test reads it the moment it appears
                (out / "ready.tmp").write_text(str(mgr.latest_step()))
                (out / "ready.tmp").replace(out / READY)
                time.sleep(600)  # the parent SIGKILLs us here; getting past this is a failure
                raise SystemExit("expected to be killed")
    write_final(state, out / FINAL)


if __name__ == "__main__":
    run(parse_args())

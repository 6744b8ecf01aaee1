"""Rank side of test_loader_hf.py: HF-style DDP training with a per-rank StatefulDataLoader.

A tiny GPT-2-like language model (transformers is not installed: token and position
embeddings, one causal self-attention block with dropout, tied LM head), AdamW, a linear
warmup schedule (``get_linear_schedule_with_warmup``'s formula), and a loader whose generator
is seeded per rank (``1000 + rank``) over a DistributedSampler or an ElasticSampler. The
state is the user's, unwrapped: ``{model, optim, sched, loader, rng, epoch, step}``; the
loader is rank-local by type. The loop is the plain one, with ``sampler.set_epoch(epoch)``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import snapstate as ss
from snapstate.data import ElasticSampler, WorkerRNG

from .common import digest, flat_tensors

VOCAB, CTX, WIDTH, SEQS, BATCH, EPOCHS, EVERY = 64, 12, 32, 48, 4, 3, 4  # 6 steps an epoch


class Tokens(Dataset):
    """Fixed token sequences; each ``__getitem__`` takes a random crop (augmentation)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(99)
        self.seqs = torch.randint(0, VOCAB, (SEQS, CTX + 3), generator=g)

    def __len__(self) -> int:
        return SEQS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(torch.randint(0, 3, ()))
        seq = self.seqs[i, start : start + CTX + 1]
        return seq[:-1], seq[1:]


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CTX, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.ln1, self.ln2, self.ln_f = (
            nn.LayerNorm(WIDTH),
            nn.LayerNorm(WIDTH),
            nn.LayerNorm(WIDTH),
        )
        self.attn = nn.MultiheadAttention(WIDTH, 2, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1)
        )
        self.register_buffer(
            "mask", torch.triu(torch.ones(CTX, CTX, dtype=torch.bool), 1), persistent=False
        )

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=self.mask, need_weights=False)[0]
        h = h + self.mlp(self.ln2(h))
        logits = self.ln_f(h) @ self.tok.weight.T  # tied head, as GPT-2
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def linear_warmup(warmup: int, total: int):  # type: ignore[no-untyped-def]
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


def setup(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    steps = EPOCHS * SEQS // (BATCH * world)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, linear_warmup(4, steps))
    workers = args.get("workers", 0)
    data = WorkerRNG(Tokens()) if workers else Tokens()
    if args.get("sampler") == "elastic":
        sampler: Any = ElasticSampler(data, num_replicas=world, rank=rank, seed=5)
    else:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
    loader = StatefulDataLoader(
        data,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        generator=torch.Generator().manual_seed(1000 + rank),
    )
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "rng": ss.RNGState()}
    if isinstance(sampler, ElasticSampler):
        state["sampler"] = sampler  # global: it resumes on any world size
    return {**state, "epoch": 0, "step": 0}


def train(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    state = setup(rank, world, args)
    ddp = DDP(state["model"])
    out = Path(args["out"])
    with ss.CheckpointManager(args["root"], async_save=True, timeout=60) as mgr:
        if args.get("resume"):
            target = {k: v for k, v in state.items() if k != args.get("skip")}
            assert mgr.restore(target) is not None
            state["epoch"], state["step"] = target["epoch"], target["step"]
        losses = open(out / f"losses-{rank}.txt", "a")
        for epoch in range(state["epoch"], EPOCHS):
            state["epoch"] = epoch
            state["loader"].sampler.set_epoch(epoch)
            for ids, labels in state["loader"]:
                state["optim"].zero_grad()
                loss = ddp(ids, labels)
                loss.backward()
                state["optim"].step()
                state["sched"].step()
                state["step"] += 1
                losses.write(f"{state['step']} {loss.item().hex()}\n")
                losses.flush()
                if state["step"] % EVERY == 0 and not args.get("no_save"):
                    mgr.save(state["step"], state)
                if state["step"] == args.get("kill_at"):
                    mgr.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
    final = {k: digest(v) for k, v in state["model"].state_dict().items()}
    final.update(
        {
            f"optim/{k}": digest(v)
            for k, v in flat_tensors(state["optim"].state_dict()["state"]).items()
        }
    )
    return {"params": final, "lr": state["sched"].get_last_lr()[0].hex(), "steps": state["step"]}


def load_other_world(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Restore a 2-rank checkpoint on ``world`` ranks: what happens to the per-rank loader."""
    state = setup(rank, world, args)
    mgr = ss.CheckpointManager(args["root"])
    step = mgr.latest_step()
    try:
        ss.load(state, mgr.path(step))
    except ss.IncompatibleStateError as exc:
        refused = str(exc)
    else:
        refused = ""
    ss.load(state, mgr.path(step), rank_local="skip")
    sampler = state["loader"].sampler
    return {
        "refused": refused,
        "step": state["step"],
        "epoch": getattr(sampler, "epoch", None),
        "position": getattr(sampler, "position", None),
    }


def shuffled_per_rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """The issue's failing save: a shuffled loader seeded 1000 + rank, not wrapped; then a
    per-rank tensor left as a replica, which must be refused with the cause and the fix."""
    loader = StatefulDataLoader(
        Tokens(),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(1000 + rank),
    )
    next(iter(loader))
    ss.save({"loader": loader, "rng": ss.RNGState()}, Path(args["root"]) / "loader-only")
    manifest = ss.inspect(Path(args["root"]) / "loader-only")
    per_rank = {r: sorted(part.trees) for r, part in manifest.rank_local.items()}
    try:
        ss.save({"loader": loader, "seen": torch.tensor([rank])}, Path(args["root"]) / "counter")
    except ss.ReplicaMismatchError as exc:
        refused = str(exc)
    else:
        refused = ""
    # The fix the message names: the check skipped for that key saves rank 0's copy.
    skip = ss.SaveOptions(unchecked_replicas=("seen",))
    counter = {"loader": loader, "seen": torch.tensor([rank])}
    ss.save(counter, Path(args["root"]) / "counter-unchecked", options=skip)
    saved = {"seen": torch.tensor([-1])}
    ss.load(saved, Path(args["root"]) / "counter-unchecked", strict=False)
    return {
        "per_rank": {str(r): k for r, k in per_rank.items()},
        "refused": refused,
        "unchecked_saved": int(saved["seen"]),
    }

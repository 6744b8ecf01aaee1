"""One rank's data-parallel training state and step, the same for every method."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from snapstate.bench.datasets import augment, make_dataset, make_loader
from snapstate.bench.models import build_model, gpt_config, parse_model


@dataclass(frozen=True)
class TrainConfig:
    """What defines a training run; two runs with equal configs compute the same numbers."""

    model: str
    batch: int = 16
    lr: float = 1e-3
    seed: int = 0
    samples: int = 2048
    schedule_steps: int = 1000
    data_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pick_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Model (DDP-wrapped), AdamW, cosine schedule, stateful loader, and the step counter."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = pick_device(rank)
        self.spec = parse_model(cfg.model)
        torch.use_deterministic_algorithms(True, warn_only=True)
        seed_everything(cfg.seed * 1000 + rank)  # per-rank streams: augmentations differ by rank
        self.module = build_model(cfg.model, cfg.seed).to(self.device)
        self.model: nn.Module = self._wrap(self.module)
        self.optim = torch.optim.AdamW(self.module.parameters(), lr=cfg.lr)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.optim, T_max=cfg.schedule_steps
        )
        self.loader = make_loader(self._dataset(), cfg.batch, rank, world, cfg.seed)
        self.step = 0
        self.epoch = 0
        self._it: Any = None

    def _wrap(self, module: nn.Module) -> nn.Module:
        if not dist.is_initialized():
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def _dataset(self) -> Any:
        if self.spec.kind == "text":
            g = gpt_config(self.spec)
            return make_dataset("text", self.cfg.samples, None, self.cfg.seed, g.block, g.vocab)
        return make_dataset("image", self.cfg.samples, self.cfg.data_dir, self.cfg.seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch; a new epoch reshuffles (the sampler's epoch is part of the state)."""
        while True:
            if self._it is None:
                self.loader.sampler.set_epoch(self.epoch)
                self._it = iter(self.loader)
            try:
                x, y = next(self._it)
                return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            except StopIteration:
                self.epoch += 1
                self._it = None

    def train_step(self) -> float:
        """One optimizer step; returns this rank's loss."""
        self.model.train()
        x, y = self.next_batch()
        if self.spec.kind == "image":
            x = augment(x)
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        self.sched.step()
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return float(loss.detach())

    def restart_data(self) -> None:
        """Forget the live iterator, so the next batch comes from the (restored) loader state."""
        self._it = None

    def init_optimizer_state(self) -> None:
        """Create AdamW's lazy state with a zero-lr step, so a load has tensors to fill."""
        if self.optim.state:
            return
        lrs = [g["lr"] for g in self.optim.param_groups]
        for g in self.optim.param_groups:
            g["lr"] = 0.0
        for p in self.module.parameters():
            p.grad = torch.zeros_like(p)
        self.optim.step()
        for g, lr in zip(self.optim.param_groups, lrs, strict=True):
            g["lr"] = lr
        self.optim.zero_grad(set_to_none=True)

    def unique_state_bytes(self) -> int:
        """Bytes of one copy of the tensors a full checkpoint holds (model and optimizer)."""
        from snapstate.bench.measure import state_bytes

        return state_bytes(self.module.state_dict()) + state_bytes(self.optim.state_dict())

    def param_count(self) -> int:
        from snapstate.bench.models import count_params

        return count_params(self.module)

    def final_params(self) -> dict[str, Any]:
        """The model's tensors as numpy arrays, for the bitwise resume check."""
        return {k: v.detach().cpu().numpy().copy() for k, v in self.module.state_dict().items()}


def init_distributed(rank: int, world: int, timeout_s: float = 300.0) -> None:
    """Join the process group from the environment: gloo on CPU, NCCL (plus gloo) on GPU."""
    from datetime import timedelta

    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(pick_device(rank))
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def quiet_known_warnings() -> None:
    """Silence torchdata's deprecation notice that every loader iteration would print."""
    import warnings

    warnings.filterwarnings("ignore", message=".*set_vital.*")


def set_threads(world: int) -> None:
    """Share the cores among the ranks so two ranks on two cores do not fight."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(int(os.environ.get("SNAPSTATE_BENCH_THREADS", max(1, cores // local))))

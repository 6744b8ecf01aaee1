"""PyTorch's methods: torch.save (rank 0 / every rank), DCP (blocking / async) and snapstate."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from snapstate.bench.methods.registry import (
    Method,
    MethodInfo,
    Pending,
    register,
    snapstate_owner,
    start_snapstate_save,
)
from snapstate.bench.train import Trainer

TORCH_RECIPE = ("model", "optimizer", "scheduler", "step", "epoch")
TORCH_RESUME_NOTE = (
    "the usual recipe saves model, optimizer, scheduler and step only: after a restart the "
    "data loader begins its epoch again (batches already seen are seen twice) and the RNG "
    "streams (augmentation, dropout) start from the seed, not from where they were"
)


def torch_recipe_state(trainer: Trainer) -> dict[str, Any]:
    return {
        "model": trainer.module.state_dict(),
        "optim": trainer.optim.state_dict(),
        "sched": trainer.sched.state_dict(),
        "step": trainer.step,
        "epoch": trainer.epoch,
    }


def torch_recipe_restore(trainer: Trainer, sd: dict[str, Any]) -> None:
    trainer.module.load_state_dict(sd["model"])
    trainer.optim.load_state_dict(sd["optim"])
    trainer.sched.load_state_dict(sd["sched"])
    trainer.step, trainer.epoch = int(sd["step"]), int(sd["epoch"])
    trainer.restart_data()


def torch_save_durable(obj: dict[str, Any], file: Path) -> None:
    """torch.save plus fsync: every method in the harness is timed until its bytes are durable."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@register
class TorchRank0(Method):
    """torch.save of the full state on rank 0, as people do with DDP."""

    info = MethodInfo(
        "torch-rank0",
        "torch",
        "torch.save (zip of pickled objects)",
        TORCH_RECIPE,
        False,
        "rank 0 writes one file",
        TORCH_RESUME_NOTE,
    )

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        if self.rank == 0:
            torch_save_durable(torch_recipe_state(trainer), path / "checkpoint.pt")
        pending.finish()

    def load(self, trainer: Trainer, path: Path) -> None:
        sd = torch.load(path / "checkpoint.pt", map_location=trainer.device, weights_only=True)
        torch_recipe_restore(trainer, sd)


@register
class TorchAllRanks(Method):
    """torch.save on every rank: the redundant pattern (one full copy per rank)."""

    info = MethodInfo(
        "torch-allranks",
        "torch",
        "torch.save (zip of pickled objects)",
        TORCH_RECIPE,
        False,
        "every rank writes a full copy",
        TORCH_RESUME_NOTE,
    )

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        torch_save_durable(torch_recipe_state(trainer), path / f"rank{self.rank:05d}.pt")
        pending.finish()

    def load(self, trainer: Trainer, path: Path) -> None:
        sd = torch.load(
            path / f"rank{self.rank:05d}.pt", map_location=trainer.device, weights_only=True
        )
        torch_recipe_restore(trainer, sd)

    def owner(self, relpath: str) -> int:
        m = re.search(r"rank(\d+)", relpath)
        return int(m.group(1)) if m else 0


class _DCPBase(Method):
    """torch.distributed.checkpoint with get_state_dict, the recipe of its tutorial."""

    def _state(self, trainer: Trainer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(trainer.model, trainer.optim)
        sched = trainer.sched.state_dict()
        return {
            "model": msd,
            "optim": osd,
            "sched": sched,
            "step": trainer.step,
            "epoch": trainer.epoch,
        }

    def load(self, trainer: Trainer, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        trainer.init_optimizer_state()
        sd = self._state(trainer)
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(
            trainer.model, trainer.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        trainer.sched.load_state_dict(sd["sched"])
        trainer.step, trainer.epoch = int(sd["step"]), int(sd["epoch"])
        trainer.restart_data()

    def owner(self, relpath: str) -> int:
        # DCP names data files __<rank>_<n>.distcp; rank 0 writes .metadata.
        m = re.match(r"__(\d+)_\d+\.distcp$", os.path.basename(relpath))
        return int(m.group(1)) if m else 0

    @classmethod
    def unavailable(cls, world: int = 1) -> str | None:
        return None if dist.is_available() else "torch.distributed is not available"


@register
class DCP(_DCPBase):
    info = MethodInfo(
        "dcp",
        "torch",
        "DCP (.distcp files + pickled .metadata)",
        TORCH_RECIPE,
        False,
        "every rank writes a share of the replicated state",
        TORCH_RESUME_NOTE,
    )

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(trainer), checkpoint_id=str(path))
        pending.finish()


@register
class DCPAsync(_DCPBase):
    info = MethodInfo(
        "dcp-async",
        "torch",
        "DCP (.distcp files + pickled .metadata)",
        TORCH_RECIPE,
        True,
        "every rank writes a share of the replicated state",
        TORCH_RESUME_NOTE,
    )

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        # Its own gloo group: the background save must not share the training group's collectives.
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        import torch.distributed.checkpoint as dcp

        future = dcp.async_save(
            self._state(trainer), checkpoint_id=str(path), process_group=self._group
        )
        if hasattr(future, "upload_completion"):  # AsyncSaveResponse when staging is async too
            future = future.upload_completion
        future.add_done_callback(lambda f: pending.finish(f.exception()))


class _SnapstateBase(Method):
    """snapstate: the full training state (RNG and data position included) in snapstate/2."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._state: dict[str, Any] | None = None

    @classmethod
    def unavailable(cls, world: int = 1) -> str | None:
        import importlib.util

        try:
            import snapstate as ss
        except ImportError as e:
            return f"snapstate core not importable ({e})"
        missing = [n for n in ("save", "async_save", "load", "RNGState") if not hasattr(ss, n)]
        if missing:
            return f"snapstate core lacks {', '.join(missing)}"
        # Without its torch.distributed coordinator snapstate treats every rank as a lone
        # process, and N ranks would race on one checkpoint directory.
        if world > 1 and importlib.util.find_spec("snapstate.collective.torch_dist") is None:
            return "multi-rank save (snapstate.collective.torch_dist) is not in this build yet"
        return None

    def state(self, trainer: Trainer) -> dict[str, Any]:
        """The state dict handed to snapstate; built once so its structure (and plan) is stable."""
        import snapstate as ss

        if self._state is None:
            self._state = {
                "model": trainer.module,
                "optim": trainer.optim,
                "sched": trainer.sched,
                "loader": trainer.loader,
                "rng": ss.RNGState(),
                "step": 0,
                "epoch": 0,
            }
        self._state["step"], self._state["epoch"] = trainer.step, trainer.epoch
        return self._state

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        start_snapstate_save(self.state(trainer), path, pending, self.info.asynchronous)

    def load(self, trainer: Trainer, path: Path) -> None:
        import snapstate as ss

        trainer.init_optimizer_state()
        state = self.state(trainer)
        ss.load(state, str(path))
        trainer.step, trainer.epoch = int(state["step"]), int(state["epoch"])
        trainer.restart_data()

    def owner(self, relpath: str) -> int:
        return snapstate_owner(relpath)


SNAPSTATE_SAVES = (
    "model",
    "optimizer",
    "scheduler",
    "data loader position",
    "RNG (per rank)",
    "step",
    "epoch",
)
SNAPSTATE_NOTE = (
    "saves RNG streams and the data loader position, so the resumed run takes the same path"
)


@register
class Snapstate(_SnapstateBase):
    info = MethodInfo(
        "snapstate",
        "torch",
        "snapstate/2 (JSON manifest + safetensors shards)",
        SNAPSTATE_SAVES,
        False,
        "every rank writes a byte-balanced share, replicated data once",
        SNAPSTATE_NOTE,
    )


@register
class SnapstateAsync(_SnapstateBase):
    info = MethodInfo(
        "snapstate-async",
        "torch",
        "snapstate/2 (JSON manifest + safetensors shards)",
        SNAPSTATE_SAVES,
        True,
        "every rank writes a byte-balanced share, replicated data once",
        SNAPSTATE_NOTE,
    )

"""The fastest peers: torchsnapshot (blocking and async) and DLRover's flash checkpoint.

Both are measured as their users run them, and both report done before their bytes are
durable: torchsnapshot never fsyncs, and DLRover's saver process writes with ``torch.save``
and no fsync. The report says so (MethodInfo.fsynced) instead of timing an fsync they do not do.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from snapstate.bench.methods.registry import Method, MethodInfo, Pending, register
from snapstate.bench.methods.torch_methods import (
    TORCH_RECIPE,
    TORCH_RESUME_NOTE,
    torch_recipe_restore,
    torch_recipe_state,
)
from snapstate.bench.train import Trainer


class _TorchSnapshotBase(Method):
    """torchsnapshot's app_state recipe: model, optimizer, scheduler and a progress dict;
    the DDP module's tensors declared replicated, so each is written once."""

    def _app_state(self, trainer: Trainer) -> dict[str, Any]:
        from torchsnapshot import StateDict

        progress = StateDict(step=trainer.step, epoch=trainer.epoch)
        return {
            "model": trainer.module,
            "optim": trainer.optim,
            "sched": trainer.sched,
            "progress": progress,
        }

    def load(self, trainer: Trainer, path: Path) -> None:
        from torchsnapshot import Snapshot

        trainer.init_optimizer_state()
        app_state = self._app_state(trainer)
        Snapshot(path=str(path)).restore(app_state=app_state)
        trainer.step = int(app_state["progress"]["step"])
        trainer.epoch = int(app_state["progress"]["epoch"])
        trainer.restart_data()

    def owner(self, relpath: str) -> int:
        # torchsnapshot writes <rank>/... per rank, replicated/... and .snapshot_metadata
        first = relpath.split("/", 1)[0]
        return int(first) if first.isdigit() else 0


_TS_FORMAT = "torchsnapshot (one file per tensor + YAML metadata)"
_TS_WRITERS = "every rank writes a share of the replicated state"


@register
class TorchSnapshot(_TorchSnapshotBase):
    info = MethodInfo(
        "torchsnapshot",
        "peers",
        _TS_FORMAT,
        TORCH_RECIPE,
        False,
        _TS_WRITERS,
        TORCH_RESUME_NOTE,
        fsynced=False,
    )

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        from torchsnapshot import Snapshot

        Snapshot.take(path=str(path), app_state=self._app_state(trainer), replicated=["**"])
        pending.finish()


@register
class TorchSnapshotAsync(_TorchSnapshotBase):
    info = MethodInfo(
        "torchsnapshot-async",
        "peers",
        _TS_FORMAT,
        TORCH_RECIPE,
        True,
        _TS_WRITERS,
        TORCH_RESUME_NOTE,
        fsynced=False,
    )

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        from torchsnapshot import Snapshot

        snapshot = Snapshot.async_take(
            path=str(path), app_state=self._app_state(trainer), replicated=["**"]
        )
        _finish_when(pending, snapshot.wait)


@register
class DLRoverFlash(Method):
    """DLRover's flash checkpoint (DdpCheckpointer, disk storage): the state is copied into
    shared memory and a saver writes it from there; rank 0 writes the model, as under DDP.

    Standalone (no ``dlrover-run`` agent) it starts its saver inside the training process.
    It saves into ``<dir>/<step>/``; the harness names checkpoints ``step-N``, so each step's
    folder is renamed once DLRover has committed it (its ``dlrover_latest.txt`` names it).
    """

    info = MethodInfo(
        "dlrover-flash",
        "peers",
        "DLRover flash checkpoint (torch.save per rank from shared memory)",
        TORCH_RECIPE,
        True,
        "rank 0 writes one file",
        TORCH_RESUME_NOTE,
        fsynced=False,
    )
    POLL_S = 0.002

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._checkpointer: Any = None

    def _checkpointer_for(self, root: Path) -> Any:
        if self._checkpointer is None:
            for name, value in (("RANK", self.rank), ("WORLD_SIZE", self.world)):
                os.environ.setdefault(name, str(value))
            os.environ.setdefault("LOCAL_RANK", str(self.rank))
            os.environ.setdefault("LOCAL_WORLD_SIZE", str(self.world))
            from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

            self._checkpointer = DdpCheckpointer(str(root))
        return self._checkpointer

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        from dlrover.trainer.torch.flash_checkpoint.ddp import StorageType

        checkpointer = self._checkpointer_for(path.parent)
        step = trainer.step
        checkpointer.save_checkpoint(
            step, torch_recipe_state(trainer), storage_type=StorageType.DISK
        )
        if self.rank != 0:  # rank 0 writes the only file; the others are done
            pending.finish()
            return
        _finish_when(pending, lambda: _wait_committed(path, step, self.POLL_S))

    def load(self, trainer: Trainer, path: Path) -> None:
        import torch

        sd = torch.load(path / "rank_0.pt", map_location=trainer.device, weights_only=True)
        torch_recipe_restore(trainer, sd)

    def owner(self, relpath: str) -> int:
        m = re.search(r"rank_(\d+)", relpath)
        return int(m.group(1)) if m else 0


def _wait_committed(path: Path, step: int, poll_s: float, timeout_s: float = 600.0) -> None:
    """Until DLRover names ``step`` its latest, then move its folder to ``path``."""
    latest = path.parent / "dlrover_latest.txt"
    deadline = time.monotonic() + timeout_s
    while not (latest.exists() and latest.read_text().strip() == str(step)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"DLRover did not commit step {step} within {timeout_s} s")
        time.sleep(poll_s)
    os.replace(path.parent / str(step), path)


def _finish_when(pending: Pending, wait: Any) -> None:
    """Finish ``pending`` from a thread once ``wait()`` returns (or with its error)."""

    def run() -> None:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - reported through pending.wait()
            pending.finish(exc)
            return
        pending.finish()

    threading.Thread(target=run, name="bench-peer-wait", daemon=True).start()

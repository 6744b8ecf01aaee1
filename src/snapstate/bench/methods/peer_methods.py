"""The fastest peers: torchsnapshot (blocking and async) and DLRover's flash checkpoint.

Both are measured as their users run them, and both report done before their bytes are
durable: torchsnapshot never fsyncs, and DLRover's saver process writes with ``torch.save``
and no fsync. The report says so (MethodInfo.fsynced) instead of timing an fsync they do not do.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
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

SOCKETS = Path("/tmp/ckpt_sock")  # DLRover's folder of local sockets (SOCKET_TMP_DIR)


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

            if os.environ.get("ROLE_NAME") != "dlrover-trainer":  # no dlrover-run agent
                _own_sockets(root)
                _spawn_saver(int(os.environ["LOCAL_RANK"]))
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

    def close(self) -> None:
        super().close()
        if self._checkpointer is None:
            return
        from dlrover.trainer.torch.flash_checkpoint import engine

        saver = engine.CheckpointEngine.saver_proc
        if saver is not None and saver.is_alive():
            saver.terminate()  # it serves no one after this method's last save
            saver.join(timeout=10)
        if os.environ.get("TORCHELASTIC_RUN_ID", "").startswith("ssb-") and self.rank == 0:
            shutil.rmtree(SOCKETS / os.environ["TORCHELASTIC_RUN_ID"], ignore_errors=True)

    def load(self, trainer: Trainer, path: Path) -> None:
        import torch

        sd = torch.load(path / "rank_0.pt", map_location=trainer.device, weights_only=True)
        torch_recipe_restore(trainer, sd)

    def owner(self, relpath: str) -> int:
        m = re.search(r"rank_(\d+)", relpath)
        return int(m.group(1)) if m else 0


def _own_sockets(root: Path) -> None:
    """Give this run its own folder of DLRover's local sockets (``/tmp/ckpt_sock/<run id>``).

    DLRover names the folder after TORCHELASTIC_RUN_ID, unset (or torchrun's "none") outside
    ``dlrover-run``: every run then shares one folder, and a socket file left by an earlier
    run's saver looks ready while nothing listens on it. The id comes from what all ranks of
    one launch share: the checkpoint folder and the rendezvous port.
    """
    launch = f"{root.resolve()}:{os.environ.get('MASTER_PORT', '')}"
    os.environ["TORCHELASTIC_RUN_ID"] = (
        "ssb-" + hashlib.blake2b(launch.encode(), digest_size=6).hexdigest()
    )


def _spawn_saver(local_rank: int) -> None:
    """Start DLRover's saver process, as it would itself without an agent, but spawned.

    DLRover forks it from the training process; a fork taken while other threads (gloo's,
    an earlier method's writers) hold locks can leave the child stuck before it listens,
    and the trainer then gives up after 30 refused connections. A spawned child starts clean.
    """
    import multiprocessing

    from dlrover.trainer.torch.flash_checkpoint import engine

    if local_rank != 0 or engine.CheckpointEngine.saver_proc is not None:
        return
    proc = multiprocessing.get_context("spawn").Process(
        target=engine.start_async_save, name="dlrover-saver", daemon=True
    )
    proc.start()
    engine.CheckpointEngine.saver_proc = proc  # the engine starts none of its own then


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

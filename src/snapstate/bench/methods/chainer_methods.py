"""Chainer's methods: the snapshot extension (NPZ), ChainerMN's multi-node checkpointer, snapstate.

Each drives the objects of ``snapstate.bench.chainer_train``: a ``chainer.training.Trainer``
whose updater holds the optimizer and the data iterator, as Chainer users train.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from snapstate.bench.methods.registry import (
    Method,
    MethodInfo,
    Pending,
    SnapstateAdapterMethod,
    fsync_tree,
    register,
)

CHAINER_SAVES = ("model", "optimizer", "iterator position", "iteration")
CHAINER_NOTE = (
    "the trainer snapshot keeps the updater (model, optimizer, iterator position) but not "
    "numpy's global generator, which Chainer draws augmentation from: after a restart the "
    "flips start from the seed"
)
SNAPSHOT_NAME = "snapshot_iter_{.updater.iteration}"


@register
class ChainerSnapshot(Method):
    """``trainer.extend(extensions.snapshot())`` on rank 0, as ChainerMN's examples do."""

    info = MethodInfo(
        "chainer-snapshot",
        "chainer",
        "NPZ (numpy .npz of the serialized trainer)",
        CHAINER_SAVES,
        False,
        "rank 0 writes one file",
        CHAINER_NOTE,
    )

    def _start(self, trainer: Any, path: Path, pending: Pending) -> None:
        from chainer.training import extensions

        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            trainer.trainer.out = str(path)
            extensions.snapshot(filename=SNAPSHOT_NAME)(trainer.trainer)
            fsync_tree(path)
        pending.finish()

    def load(self, trainer: Any, path: Path) -> None:
        import chainer

        files = sorted(path.glob("snapshot_iter_*"))
        if not files:
            raise FileNotFoundError(f"{path}: no Chainer snapshot_iter_* file")
        chainer.serializers.load_npz(str(files[-1]), trainer.trainer)


MN_NAME = "snapshot"
MN_FILE = re.compile(rf"(?:^|/){MN_NAME}\.(\d+)\.(\d+)$")


@register
class ChainerMNCheckpointer(Method):
    """``chainermn.create_multi_node_checkpointer``: every rank saves its own full snapshot."""

    info = MethodInfo(
        "chainermn-checkpointer",
        "chainer",
        "NPZ (one serialized trainer per rank)",
        CHAINER_SAVES,
        False,
        "every rank writes a full copy",
        CHAINER_NOTE,
    )

    def _checkpointer(self, trainer: Any, path: Path) -> Any:
        import chainermn

        if trainer.comm is None:
            raise RuntimeError("ChainerMN's checkpointer needs a communicator: run under mpirun")
        return chainermn.create_multi_node_checkpointer(MN_NAME, trainer.comm, path=str(path))

    def _start(self, trainer: Any, path: Path, pending: Pending) -> None:
        self._checkpointer(trainer, path).save(trainer.trainer, trainer.step)
        fsync_tree(path / f"{MN_NAME}.{self.rank}.{trainer.step}")
        pending.finish()

    def load(self, trainer: Any, path: Path) -> None:
        checkpointer = self._checkpointer(trainer, path)
        checkpointer.maybe_load(trainer.trainer, trainer.optimizer)
        if not checkpointer.files:
            raise FileNotFoundError(f"{path}: no ChainerMN snapshot common to every rank")

    def owner(self, relpath: str) -> int:
        m = MN_FILE.search(relpath)
        return int(m.group(1)) if m else 0


SNAPSTATE_CHAINER_SAVES = (
    "model",
    "optimizer",
    "numpy RNG (per rank)",
    "iterator position",
    "iteration",
)
SNAPSTATE_CHAINER_NOTE = (
    "saves numpy's generator per rank and the iterator position, so the resumed run takes "
    "the same path"
)


@register
class SnapstateChainer(SnapstateAdapterMethod):
    integration = "snapstate.integrations.chainer"

    info = MethodInfo(
        "snapstate-chainer",
        "chainer",
        "snapstate/2 (JSON manifest + safetensors shards)",
        SNAPSTATE_CHAINER_SAVES,
        False,
        "every rank writes a byte-balanced share, replicated data once",
        SNAPSTATE_CHAINER_NOTE,
    )


@register
class SnapstateChainerAsync(SnapstateAdapterMethod):
    integration = "snapstate.integrations.chainer"

    info = MethodInfo(
        "snapstate-chainer-async",
        "chainer",
        "snapstate/2 (JSON manifest + safetensors shards)",
        SNAPSTATE_CHAINER_SAVES,
        True,
        "every rank writes a byte-balanced share, replicated data once",
        SNAPSTATE_CHAINER_NOTE,
    )

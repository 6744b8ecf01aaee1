"""TensorFlow's methods: tf.train.Checkpoint with CheckpointManager, Keras ModelCheckpoint, snapstate.

Multi-worker saves follow TensorFlow's documented pattern for ``MultiWorkerMirroredStrategy``:
every worker calls save (the save may run collectives), the chief writes the real directory and
the other workers write a temporary one that they delete afterwards.
"""

from __future__ import annotations

import functools
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from snapstate.bench.methods.registry import (
    Method,
    MethodInfo,
    Pending,
    SnapstateAdapterMethod,
    fsync_tree,
    register,
    watch,
)

TF_RECIPE = ("model", "optimizer", "step", "epoch")
TF_NOTE = (
    "the documented recipe saves model, optimizer and step: after a restart the epoch's "
    "batches are taken again from its start and tf.random's global generator (augmentation) "
    "starts from its seed, not from where it was"
)
KERAS_NOTE = (
    "ModelCheckpoint saves the model and its optimizer; step and epoch come back only through "
    "the file name; the data order restarts its epoch and the RNG stream its seed"
)


def worker_temp_dir(rank: int, path: Path) -> Path:
    """A non-chief worker's throw-away copy: beside the checkpoint, so on the same storage."""
    return path.parent / f".{path.name}.workertemp_{rank}"


@contextmanager
def write_dir(rank: int, path: Path) -> Iterator[Path]:
    """Where this worker writes: the chief the real path, the others a temporary sibling."""
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        fsync_tree(path)  # timed to durable, like every method
        return
    temp = worker_temp_dir(rank, path)
    temp.mkdir(parents=True, exist_ok=True)
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


class _TFCheckpointBase(Method):
    """tf.train.Checkpoint over the model, optimizer, step and epoch, as TF's guide writes it."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._ckpt: Any = None
        self._counters: tuple[Any, Any] | None = None

    def checkpoint(self, trainer: Any, fresh: bool = False) -> Any:
        import tensorflow as tf

        if self._counters is None:
            step = tf.Variable(0, dtype=tf.int64, trainable=False)
            epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
            self._counters = (step, epoch)
        if self._ckpt is None or fresh:
            step, epoch = self._counters
            self._ckpt = tf.train.Checkpoint(
                model=trainer.model, optimizer=trainer.optimizer, step=step, epoch=epoch
            )
        assert self._counters is not None
        self._counters[0].assign(trainer.step)
        self._counters[1].assign(trainer.epoch)
        return self._ckpt

    def load(self, trainer: Any, path: Path) -> None:
        import tensorflow as tf

        ckpt = self.checkpoint(trainer)
        latest = tf.train.latest_checkpoint(str(path))
        if latest is None:
            raise FileNotFoundError(f"{path}: no TensorFlow checkpoint (no 'checkpoint' file)")
        ckpt.restore(latest).assert_existing_objects_matched()
        assert self._counters is not None
        trainer.step, trainer.epoch = int(self._counters[0]), int(self._counters[1])
        trainer.restart_data()

    def owner(self, relpath: str) -> int:
        return 0  # the chief writes every file; the other workers' copies are deleted


@register
class TFCheckpoint(_TFCheckpointBase):
    info = MethodInfo(
        "tf-checkpoint",
        "tensorflow",
        "TF checkpoint (.index + .data-* shards, protobuf)",
        TF_RECIPE,
        False,
        "the chief writes; the other workers write a temporary copy and delete it",
        TF_NOTE,
    )

    def _start(self, trainer: Any, path: Path, pending: Pending) -> None:
        import tensorflow as tf

        ckpt = self.checkpoint(trainer)
        with write_dir(self.rank, path) as where:
            tf.train.CheckpointManager(ckpt, str(where), max_to_keep=1).save(trainer.step)
        pending.finish()


@register
class TFCheckpointAsync(_TFCheckpointBase):
    """TF's own asynchronous checkpoint (``experimental_enable_async_checkpoint``).

    With Keras 3 models (TF 2.21) a second async save through the same ``tf.train.Checkpoint``
    fails ("tf.function only supports singleton tf.Variables"): TF's helper retraces its
    device-to-host copy, which creates the host variables again. A new Checkpoint per save
    (new host buffers each time) is the workaround, and what is measured here.
    """

    info = MethodInfo(
        "tf-checkpoint-async",
        "tensorflow",
        "TF checkpoint (.index + .data-* shards, protobuf)",
        TF_RECIPE,
        True,
        "the chief writes; the other workers write a temporary copy and delete it",
        TF_NOTE,
    )

    def _start(self, trainer: Any, path: Path, pending: Pending) -> None:
        import tensorflow as tf

        ckpt = self.checkpoint(trainer, fresh=True)
        options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
        where = path if self.rank == 0 else worker_temp_dir(self.rank, path)
        where.mkdir(parents=True, exist_ok=True)
        manager = tf.train.CheckpointManager(ckpt, str(where), max_to_keep=1)
        manager.save(trainer.step, options=options)
        watch(functools.partial(self._finish, ckpt, where, pending))

    def _finish(self, ckpt: Any, where: Path, pending: Pending) -> None:
        try:
            ckpt.sync()  # returns once TF's background writer has written this save
            if self.rank == 0:
                fsync_tree(where)
            else:
                shutil.rmtree(where, ignore_errors=True)
        except BaseException as e:  # re-raised on the training thread by Pending.wait
            pending.finish(e)
            return
        pending.finish()


KERAS_FILE = "model-e{epoch:03d}-b{batch:05d}.keras"
KERAS_NAME = re.compile(r"model-e(\d+)-b(\d+)\.keras$")


@register
class KerasModelCheckpoint(Method):
    """``keras.callbacks.ModelCheckpoint(save_freq=N)``: a .keras file of the model + optimizer.

    The harness drives the callback as ``model.fit`` would: ``on_epoch_begin`` and
    ``on_train_batch_end`` at the step where it saves.
    """

    info = MethodInfo(
        "keras-modelcheckpoint",
        "tensorflow",
        "Keras .keras (zip of config JSON + HDF5 weights)",
        ("model", "optimizer", "epoch and batch (in the file name)"),
        False,
        "the chief writes; the other workers write a temporary copy and delete it",
        KERAS_NOTE,
    )

    def _start(self, trainer: Any, path: Path, pending: Pending) -> None:
        from tensorflow import keras

        if getattr(trainer.model, "optimizer", None) is not trainer.optimizer:
            # fit() users compile first; that attaches the optimizer, which .keras then holds.
            trainer.model.compile(optimizer=trainer.optimizer)
        with write_dir(self.rank, path) as where:
            callback = keras.callbacks.ModelCheckpoint(str(where / KERAS_FILE), save_freq=1)
            callback.set_model(trainer.model)
            callback.on_epoch_begin(trainer.epoch)
            # Keras names the file with epoch + 1 and batch + 1, as fit counts them.
            callback.on_train_batch_end(trainer.position - 1, logs={})
        pending.finish()

    def load(self, trainer: Any, path: Path) -> None:
        files = sorted(path.glob("model-e*-b*.keras"))
        if not files:
            raise FileNotFoundError(f"{path}: no Keras model-e*-b*.keras file")
        match = KERAS_NAME.search(files[-1].name)
        assert match is not None
        if getattr(trainer.model, "optimizer", None) is not trainer.optimizer:
            trainer.model.compile(optimizer=trainer.optimizer)
        trainer.model.load_weights(str(files[-1]))
        trainer.epoch, batch = int(match.group(1)) - 1, int(match.group(2))
        trainer.step = trainer.epoch * trainer.batches_per_epoch + batch
        trainer.restart_data()


SNAPSTATE_TF_SAVES = ("model", "optimizer", "tf.random generator (per worker)", "data position")
SNAPSTATE_TF_NOTE = (
    "saves tf.random's generator per worker and the data position, so the resumed run takes "
    "the same path"
)


@register
class SnapstateTF(SnapstateAdapterMethod):
    integration = "snapstate.integrations.tensorflow"

    info = MethodInfo(
        "snapstate-tf",
        "tensorflow",
        "snapstate/2 (JSON manifest + safetensors shards)",
        (*SNAPSTATE_TF_SAVES, "step", "epoch"),
        False,
        "every worker writes a byte-balanced share, replicated data once",
        SNAPSTATE_TF_NOTE,
    )


@register
class SnapstateTFAsync(SnapstateAdapterMethod):
    integration = "snapstate.integrations.tensorflow"

    info = MethodInfo(
        "snapstate-tf-async",
        "tensorflow",
        "snapstate/2 (JSON manifest + safetensors shards)",
        (*SNAPSTATE_TF_SAVES, "step", "epoch"),
        True,
        "every worker writes a byte-balanced share, replicated data once",
        SNAPSTATE_TF_NOTE,
    )

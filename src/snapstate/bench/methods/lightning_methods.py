"""Lightning's own CheckpointIOs beside snapstate's plug-in, on the checkpoint Lightning builds.

Each method gives the harness's model, optimizer and scheduler to a real ``lightning.Trainer``
(its strategy connected to them, the train loader in its fit loop, its progress counters kept
at the harness's step) and saves what ``trainer._checkpoint_connector.dump_checkpoint()``
returns: the dict ``Trainer.save_checkpoint`` hands its CheckpointIO. The harness drives the
training steps itself (the same steps for every method), so the public ``save_checkpoint``
path is not taken; ``Strategy.save_checkpoint`` is what remains of it, and is reproduced: on
rank 0 for Lightning's IOs, on every rank for snapstate's (as ``SnapstateCallback`` makes it).

Blocking is the whole call (Lightning's dump, then the IO's ``save_checkpoint`` until it
returns); ``dump_s`` and ``io_blocking_s`` (the IO's call alone) are kept per checkpoint, and
``lightning-ss-async`` calls ``ss.async_save`` on the same dict in place of the IO: the
report's ratio of the plug-in's IO blocking to it is the cost of the glue.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from snapstate.bench.measure import now
from snapstate.bench.methods.registry import (
    Method,
    MethodInfo,
    Pending,
    finish_when_done,
    register,
    snapstate_owner,
    watch,
)
from snapstate.bench.train import Trainer

FILE = "model.ckpt"  # the name Lightning's ModelCheckpoint would pick, inside the step folder
LIGHTNING_SAVES = ("model", "optimizer", "scheduler", "loops (loader position)", "step", "epoch")
PLUGIN_SAVES = (*LIGHTNING_SAVES, "RNG (per rank, SnapstateCallback)")
LIGHTNING_NOTE = (
    "Lightning's checkpoint holds the loops' state (the stateful loader's position) but no "
    "global RNG: the resumed run's augmentation and dropout draws differ"
)
PLUGIN_NOTE = (
    "SnapstateCallback adds every global RNG per rank: the resumed run takes the same path"
)
TORCH_FORMAT = "torch.save of Lightning's checkpoint dict (one file, no fsync)"
SS_FORMAT = "snapstate/2 of Lightning's checkpoint dict"


class _LightningBase(Method):
    """One Lightning configuration: the Trainer built on the first save, then kept."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._lt: Any = None

    def checkpoint_io(self) -> Any:
        """The CheckpointIO the user passes in ``Trainer(plugins=[...])``."""
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        return TorchCheckpointIO()

    def callbacks(self) -> list[Any]:
        return []

    def prepare(self, trainer: Trainer) -> None:
        """Build the Trainer before the first save: users build theirs before training."""
        self.lightning(trainer)

    def lightning(self, trainer: Trainer) -> Any:
        if self._lt is None:
            self._lt = attach(trainer, self.checkpoint_io(), self.callbacks())
        return self._lt

    def writes_here(self) -> bool:
        """Lightning's Strategy.save_checkpoint calls its IO on global rank 0 only."""
        return self.rank == 0

    def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
        lt = self.lightning(trainer)
        start = now()
        checkpoint = dump(lt, trainer)
        dumped = now()
        if self.writes_here():
            self.write(lt, checkpoint, path / FILE, pending)
        else:
            pending.finish()
        pending.extra.update(dump_s=dumped - start, io_blocking_s=now() - dumped)

    def write(self, lt: Any, checkpoint: dict[str, Any], file: Path, pending: Pending) -> None:
        lt.strategy.checkpoint_io.save_checkpoint(checkpoint, file)
        pending.finish()

    def read(self, lt: Any, file: Path) -> dict[str, Any]:
        return lt.strategy.checkpoint_io.load_checkpoint(file, map_location="cpu")  # type: ignore[no-any-return]

    def load(self, trainer: Trainer, path: Path) -> None:
        lt = self.lightning(trainer)
        restore(trainer, self.read(lt, path / FILE))

    def close(self) -> None:
        super().close()
        if self._lt is not None:
            self._lt.strategy.checkpoint_io.teardown()


def attach(trainer: Trainer, io: Any, callbacks: list[Any]) -> Any:
    """A real ``lightning.Trainer`` whose strategy holds ``trainer``'s module, optimizer,
    scheduler and train loader, as ``Trainer.fit`` would have set them up."""
    import lightning as L
    from lightning.pytorch.core.optimizer import LRSchedulerConfig
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    lt = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _module_class()(trainer.module)
    lt.strategy.connect(module)
    module.trainer = lt
    lt.strategy.optimizers = [trainer.optim]
    lt.strategy.lr_scheduler_configs = [LRSchedulerConfig(trainer.sched)]
    lt.fit_loop._combined_loader = CombinedLoader(trainer.loader, "max_size_cycle")
    for callback in callbacks:
        callback.setup(lt, module, "fit")
    return lt


@functools.cache
def _module_class() -> type:
    import lightning as L

    class HarnessModule(L.LightningModule):
        """The harness's network as a LightningModule (its state_dict keys: ``net.*``)."""

        def __init__(self, net: Any) -> None:
            super().__init__()
            self.net = net

    return HarnessModule


def dump(lt: Any, trainer: Trainer) -> dict[str, Any]:
    """Lightning's checkpoint dict at the harness's step and epoch."""
    loop = lt.fit_loop
    loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = (
        trainer.step
    )
    loop.epoch_progress.current.completed = trainer.epoch
    return lt._checkpoint_connector.dump_checkpoint()  # type: ignore[no-any-return]


def restore(trainer: Trainer, ckpt: dict[str, Any]) -> None:
    """Put Lightning's checkpoint back into the harness's training state, as a resumed
    ``Trainer.fit`` would: weights, optimizer, scheduler, the loader from the loops' state."""
    trainer.init_optimizer_state()
    state = {k.removeprefix("net."): v for k, v in ckpt["state_dict"].items()}
    trainer.module.load_state_dict(state)
    trainer.optim.load_state_dict(ckpt["optimizer_states"][0])
    trainer.sched.load_state_dict(ckpt["lr_schedulers"][0])
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    trainer.loader.load_state_dict(loader)
    trainer.step, trainer.epoch = int(ckpt["global_step"]), int(ckpt["epoch"])
    trainer.restart_data()


@register
class LightningTorch(_LightningBase):
    """Lightning's default CheckpointIO (TorchCheckpointIO): torch.save, blocking, rank 0."""

    info = MethodInfo(
        "lightning-torch",
        "integrations",
        TORCH_FORMAT,
        LIGHTNING_SAVES,
        False,
        "rank 0 writes one file",
        LIGHTNING_NOTE,
        fsynced=False,
    )


@register
class LightningAsync(_LightningBase):
    """Lightning's AsyncCheckpointIO: tensors cloned on the caller, then torch.save on its
    one worker thread; a save is finished when that thread reaches the task queued behind it."""

    info = MethodInfo(
        "lightning-async",
        "integrations",
        TORCH_FORMAT,
        LIGHTNING_SAVES,
        True,
        "rank 0 writes one file",
        LIGHTNING_NOTE,
        fsynced=False,
    )

    def checkpoint_io(self) -> Any:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        return AsyncCheckpointIO()

    def write(self, lt: Any, checkpoint: dict[str, Any], file: Path, pending: Pending) -> None:
        io = lt.strategy.checkpoint_io
        io.save_checkpoint(checkpoint, file)
        # One worker, first in first out: this runs once the save before it has ended.
        io._executor.submit(lambda: pending.finish(io._error))


class _SnapstateLightningBase(_LightningBase):
    """snapstate's plug-in as its docs set it up: the CheckpointIO plus SnapstateCallback."""

    def checkpoint_io(self) -> Any:
        from snapstate.integrations.lightning import SnapstateCheckpointIO

        return SnapstateCheckpointIO()

    def callbacks(self) -> list[Any]:
        from snapstate.integrations.lightning import SnapstateCallback

        return [SnapstateCallback()]

    def writes_here(self) -> bool:
        return True  # the save is collective: SnapstateCallback has every rank call the IO

    def load(self, trainer: Trainer, path: Path) -> None:
        from snapstate.integrations._read import rng_restore

        lt = self.lightning(trainer)
        ckpt = self.read(lt, path / FILE)
        restore(trainer, ckpt)
        rng_restore(ckpt["callbacks"]["SnapstateCallback"]["value"]["rng"])

    def owner(self, relpath: str) -> int:
        return snapstate_owner(relpath)


@register
class LightningSnapstate(_SnapstateLightningBase):
    """SnapstateCheckpointIO (async by default): done once committed and published."""

    info = MethodInfo(
        "lightning-snapstate",
        "integrations",
        SS_FORMAT,
        PLUGIN_SAVES,
        True,
        "every rank writes a byte-balanced share, replicated data once",
        PLUGIN_NOTE,
    )

    def write(self, lt: Any, checkpoint: dict[str, Any], file: Path, pending: Pending) -> None:
        io = lt.strategy.checkpoint_io
        io.save_checkpoint(checkpoint, file)
        watch(functools.partial(_finish_after, io.wait, pending))


@register
class LightningSnapstateBaseline(_SnapstateLightningBase):
    """The baseline of the 1.2x check: ``ss.async_save`` of the very dict the plug-in gets
    (same Trainer, same callback), into the folder the plug-in would publish."""

    info = MethodInfo(
        "lightning-ss-async",
        "integrations",
        SS_FORMAT,
        PLUGIN_SAVES,
        True,
        "every rank writes a byte-balanced share, replicated data once",
        PLUGIN_NOTE,
    )

    def write(self, lt: Any, checkpoint: dict[str, Any], file: Path, pending: Pending) -> None:
        import snapstate as ss

        handle = ss.async_save(checkpoint, str(file))
        watch(functools.partial(finish_when_done, handle, pending))

    def read(self, lt: Any, file: Path) -> dict[str, Any]:
        import snapstate as ss

        return ss.read_state(str(file), rank=self.rank)  # type: ignore[no-any-return]


def _finish_after(wait: Any, pending: Pending) -> None:
    try:
        wait()
    except BaseException as exc:  # noqa: BLE001 - raised again by pending.wait()
        pending.finish(exc)
        return
    pending.finish()

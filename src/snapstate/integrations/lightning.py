"""Lightning: checkpoints written and read by snapstate, resumed bit for bit.

    trainer = L.Trainer(plugins=[SnapstateCheckpointIO()], callbacks=[SnapstateCallback()])

``SnapstateCheckpointIO`` saves Lightning's checkpoint dict as a snapstate checkpoint directory
at the path Lightning picks (``epoch=0-step=8.ckpt`` is a directory), asynchronously by default
with the values of the moment of the call, and reads it back for ``ckpt_path=`` (a path or
``"last"``) and ``LightningModule.load_from_checkpoint``. ``SnapstateCallback`` adds what a
bitwise resume needs and Lightning does not save: every global RNG of every rank and the train
loader's position in its epoch; under DDP it makes the save collective, so that every rank
writes its share (Lightning hands the checkpoint to its CheckpointIO on rank 0 only).
Strategies that bypass CheckpointIO (FSDP, ModelParallel, DeepSpeed, XLA) are refused at set-up.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback

import snapstate as ss
from snapstate.integrations import _publish
from snapstate.integrations._read import (
    agreed,
    dist_rank,
    dist_world,
    is_checkpoint_dir,
    read_state,
    rng_restore,
    rng_snapshot,
)

SUPPORTED = "SingleDeviceStrategy (CPU or one GPU) and DDPStrategy (strategy='ddp' or 'ddp_spawn')"


class SnapstateCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO on snapstate: ``Trainer(plugins=[SnapstateCheckpointIO()])``.

    ``async_save=True`` returns once the state is staged (training goes on while it is written);
    the next save, a load, a removal and the end of training wait for it. Each save writes a
    fresh hidden directory beside the path Lightning names, which becomes a symlink to it once
    it is committed (``_publish.py``): a save killed while it overwrites ``last.ckpt`` leaves
    the previous ``last.ckpt`` in place.
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        timeout: float | None = None,
        options: ss.SaveOptions | None = None,
    ) -> None:
        self.async_save = async_save
        self.timeout = timeout
        self.options = options
        self.collective = False  # set by SnapstateCallback: every rank calls save_checkpoint
        self._publisher = _publish.Publisher()  # waits for the commit, then publishes
        self._versions = _publish.VersionIds(agreed)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"SnapstateCheckpointIO takes no storage_options (got {storage_options!r})"
            )
        if dist_world() > 1 and not self.collective:
            raise RuntimeError(
                f"saving {os.fspath(path)!r}: with {dist_world()} ranks Lightning calls the "
                "CheckpointIO on rank 0 only while a snapstate save is collective; add "
                "SnapstateCallback() to the Trainer's callbacks"
            )
        self.wait()
        path = os.fspath(path)
        target = _publish.version_dir(path, self._versions.next())
        kwargs: dict[str, Any] = {"timeout": self.timeout, "options": self.options}
        if not self.async_save:
            ss.save(checkpoint, target, **kwargs)
            _publish.publish_from(dist_rank(), path, target)
            return
        self._publisher.start_publish(
            ss.async_save(checkpoint, target, **kwargs), path, target, dist_rank()
        )

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        return read_state(path, rank=dist_rank())  # type: ignore[no-any-return]

    def remove_checkpoint(self, path: Any) -> None:
        self.wait()  # the checkpoint being removed may be the one still being written
        _publish.remove(os.fspath(path))

    def teardown(self) -> None:
        self.wait()

    def wait(self) -> None:
        """Block until the save in flight is committed and published (raises its error)."""
        self._publisher.wait()


class SnapstateCallback(Callback):
    """Makes a Lightning run with SnapstateCheckpointIO resume bit for bit, on one rank or DDP.

    Its state (saved rank-local, one copy per rank): every global RNG at the moment of the save,
    and for each train loader the RNG its epoch's order was drawn from and how many batches it
    gave. On resume the loader's order is drawn again from that RNG, the batches already trained
    on are skipped, and the RNG is set back to the moment of the save.
    """

    def __init__(self) -> None:
        self._loaders: list[_ResumableLoader] = []
        self._pending: dict[str, Any] | None = None
        self._trainer: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        refuse_unsupported(trainer.strategy)
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, SnapstateCheckpointIO):
            raise ValueError(
                f"SnapstateCallback needs SnapstateCheckpointIO, the Trainer's CheckpointIO is "
                f"{type(io).__name__}: pass Trainer(plugins=[SnapstateCheckpointIO()])"
            )
        io.collective = True
        _save_on_every_rank(trainer.strategy)
        self._trainer = trainer
        if stage == "fit":
            _adopt_loaders_on_setup(trainer.fit_loop, self)

    def state_dict(self) -> dict[str, Any]:
        consumed = 0
        if self._trainer is not None:
            consumed = self._trainer.fit_loop.epoch_loop.batch_progress.current.processed
        value = {"rng": rng_snapshot(), "loaders": [w.position(consumed) for w in self._loaders]}
        return ss.RankLocal(value)  # type: ignore[return-value]  # Stateful: saved per rank

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict["value"]  # RankLocal's state: this rank's value

    def adopt(self, combined: Any) -> None:
        """Wrap the train loaders of a CombinedLoader; hand them the position being resumed."""
        wrapped = [_ResumableLoader.of(loader) for loader in combined.flattened]
        combined.flattened = wrapped
        self._loaders = wrapped
        pending, self._pending = self._pending, None
        if pending is None:
            return
        positions = pending.get("loaders") or [None] * len(wrapped)
        if len(positions) != len(wrapped):
            raise ValueError(
                f"the checkpoint holds the position of {len(positions)} train loaders, "
                f"this run has {len(wrapped)}"
            )
        for loader, position in zip(wrapped, positions):
            loader.resume = {"rng": pending["rng"], "position": position}


def refuse_unsupported(strategy: Any) -> None:
    """Raise unless ``strategy`` hands whole checkpoints to its CheckpointIO on every rank."""
    from lightning.pytorch import strategies as s

    bypass = tuple(
        getattr(s, name)
        for name in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy", "XLAStrategy")
        if hasattr(s, name)
    )
    single_xla = getattr(s, "SingleDeviceXLAStrategy", ())
    ok = isinstance(strategy, (s.SingleDeviceStrategy, s.DDPStrategy))
    if not ok or isinstance(strategy, bypass) or (single_xla and isinstance(strategy, single_xla)):
        raise ValueError(
            f"snapstate's Lightning integration does not support {type(strategy).__name__}: its "
            f"checkpoints bypass the CheckpointIO; supported: {SUPPORTED}"
        )


def _save_on_every_rank(strategy: Any) -> None:
    # Strategy.save_checkpoint calls the CheckpointIO on global rank 0 only; every rank reaches
    # it (Trainer.save_checkpoint runs everywhere, then a barrier), so the collective save fits.
    def save_checkpoint(
        checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        strategy.checkpoint_io.save_checkpoint(
            checkpoint, filepath, storage_options=storage_options
        )

    strategy.save_checkpoint = save_checkpoint


def _adopt_loaders_on_setup(fit_loop: Any, callback: SnapstateCallback) -> None:
    # FitLoop.setup_data builds the CombinedLoader, then loads loader states, then calls iter():
    # the one point where the loaders exist and no batch was drawn yet.
    original = type(fit_loop)._load_combined_loader_states

    def load_combined_loader_states() -> None:
        if fit_loop._combined_loader is not None:
            callback.adopt(fit_loop._combined_loader)
        original(fit_loop)

    fit_loop._load_combined_loader_states = load_combined_loader_states


class _ResumableLoader:
    """A train loader that knows where its epoch stands, and can be put back there."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch_rng: dict[str, Any] | None = None  # the generators before this epoch's iter()
        self.yielded = 0
        self.exhausted = False
        self.resume: dict[str, Any] | None = None

    @classmethod
    def of(cls, loader: Any) -> _ResumableLoader:
        return loader if isinstance(loader, cls) else cls(loader)

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, batch_size... as the loader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    # Lightning's _Stateful protocol: a stateful loader keeps its "not resumable" warning away.
    # The position itself is rank-local, so it travels in SnapstateCallback's state.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def position(self, consumed: int) -> dict[str, Any] | None:
        if self.epoch_rng is None:
            return None
        finished = self.exhausted or (_sized(self.loader) and self.yielded >= len(self.loader))
        return {
            "epoch_rng": self.epoch_rng,
            "yielded": self.yielded,
            "consumed": min(consumed, self.yielded),
            "finished": finished,
        }

    def __iter__(self) -> Iterator[Any]:
        resume, self.resume = self.resume, None
        position = resume["position"] if resume else None
        if position and (not position["finished"] or position["consumed"] < position["yielded"]):
            return self._replay(position, resume["rng"])  # type: ignore[index]
        if resume:
            rng_restore(resume["rng"])
        return self._fresh()

    def _fresh(self) -> Iterator[Any]:
        # Drawn at the first batch, so that the epoch's RNG is the one its order comes from.
        self.epoch_rng, self.yielded, self.exhausted = rng_snapshot(), 0, False
        yield from self._count(iter(self.loader), [])

    def _replay(self, position: dict[str, Any], rng: dict[str, Any]) -> Iterator[Any]:
        # The same order from the same generators; batches fetched but not yet trained on
        # (Lightning prefetches from loaders without a length) are given again.
        rng_restore(position["epoch_rng"])
        it = iter(self.loader)
        kept: deque[Any] = deque(maxlen=position["yielded"] - position["consumed"])
        for n in range(position["yielded"]):
            try:
                kept.append(next(it))
            except StopIteration:
                raise ValueError(
                    f"resuming the train loader at batch {position['yielded']}: "
                    f"this run's loader ends after {n} batches"
                ) from None
        self.epoch_rng, self.yielded, self.exhausted = (
            position["epoch_rng"],
            position["yielded"],
            False,
        )
        rng_restore(rng)
        return self._count(it, list(kept))

    def _count(self, it: Iterator[Any], kept: list[Any]) -> Iterator[Any]:
        yield from kept
        for batch in it:
            self.yielded += 1
            yield batch
        self.exhausted = True


def _sized(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def _install_load_from_checkpoint() -> None:
    """``LightningModule.load_from_checkpoint(dir)`` reads snapstate checkpoint directories."""
    from lightning.pytorch.core import saving

    original = saving.pl_load
    if getattr(original, "snapstate", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if is_checkpoint_dir(path_or_url):
            return read_state(path_or_url, rank=dist_rank())
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load.snapstate = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load


_install_load_from_checkpoint()

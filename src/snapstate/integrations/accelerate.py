"""Accelerate: a plain ``Accelerator`` loop checkpointed by snapstate and resumed bit for bit.

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    ckpt = SnapstateAccelerate(accelerator)      # after prepare()
    extra = ckpt.load(path)                      # on resume, before the loop
    ...  ckpt.save(path, extra={"step": step})  ...   # where the loop checkpoints; collective

``save`` writes, through snapstate and without pickle, every prepared model (unwrapped),
optimizer and scheduler, every RNG of every process, and each prepared loader's position:
the generators its epoch's order was drawn from, its epoch counter and how many batches it
gave. It is asynchronous (the state of the moment of the call is staged, then written while
training goes on) and collective over the Accelerator's processes. After ``load`` the loader's
next ``iter()`` draws the same order again, skips the batches already trained on and sets every
RNG back to the moment of the save. The same for ``DataLoaderShard`` and ``DataLoaderDispatcher``,
with or without ``use_stateful_dataloader`` and ``use_seedable_sampler``: Accelerate's own loader
state (``dl_state_dict``) is not used.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

import snapstate as ss
from snapstate.integrations import _publish
from snapstate.integrations._read import agreed, read_state, rng_restore, rng_snapshot

_TRACKER = "_snapstate_position"


class SnapstateAccelerate:
    """Saves and loads what ``accelerator.prepare`` returned, through snapstate."""

    def __init__(self, accelerator: Any, *, async_save: bool = True, timeout: float | None = None):
        self.accelerator = accelerator
        self.async_save = async_save
        self.timeout = timeout
        self.loaders = [_Position.attach(dl) for dl in accelerator._dataloaders]
        self._publisher = _publish.Publisher()  # waits for the commit, then publishes
        self._versions = _publish.VersionIds(agreed)

    def state(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """What ``save`` writes: plain state dicts, the RNG and positions rank-local."""
        acc = self.accelerator
        rank_local = {"rng": rng_snapshot(), "loaders": [p.state() for p in self.loaders]}
        return {
            "models": [acc.unwrap_model(m).state_dict() for m in acc._models],
            "optimizers": [o.optimizer.state_dict() for o in acc._optimizers],
            "schedulers": [s.scheduler.state_dict() for s in acc._schedulers],
            "rank_local": ss.RankLocal(rank_local),
            "extra": dict(extra or {}),
        }

    def save(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """Checkpoint to ``path`` (a directory, replaced atomically); every process calls it.

        ``extra``: the loop's own values (the step count), given back by :meth:`load`.
        """
        self.wait()
        path = os.fspath(path)
        target = _publish.version_dir(path, self._versions.next())
        rank = self.accelerator.process_index
        if not self.async_save:
            ss.save(self.state(extra), target, timeout=self.timeout)
            _publish.publish_from(rank, path, target)
            return
        handle = ss.async_save(self.state(extra), target, timeout=self.timeout)
        self._publisher.start_publish(handle, path, target, rank)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Put everything back as ``save`` found it; the loaders resume at their next iter().

        Returns the ``extra`` values the save was given.
        """
        self.wait()
        acc = self.accelerator
        state = read_state(path, rank=acc.process_index)
        _load_each(path, "models", [acc.unwrap_model(m) for m in acc._models], state)
        _load_each(path, "optimizers", [o.optimizer for o in acc._optimizers], state)
        _load_each(path, "schedulers", [s.scheduler for s in acc._schedulers], state)
        local = state["rank_local"]["value"]  # RankLocal read back: this rank's value
        if len(local["loaders"]) != len(self.loaders):
            raise ValueError(
                f"{os.fspath(path)}: the checkpoint holds {len(local['loaders'])} loaders' "
                f"positions, this run prepared {len(self.loaders)}"
            )
        for position, saved in zip(self.loaders, local["loaders"]):
            position.resume_from(saved, local["rng"])
        rng_restore(local["rng"])
        return dict(state["extra"])

    def wait(self) -> None:
        """Block until the save in flight is committed and published (raises its error)."""
        self._publisher.wait()


def _load_each(path: Any, key: str, objects: list[Any], state: dict[str, Any]) -> None:
    saved = state[key]
    if len(saved) != len(objects):
        raise ValueError(
            f"{os.fspath(path)}: key {key!r} holds {len(saved)} entries, this run prepared "
            f"{len(objects)}"
        )
    for obj, value in zip(objects, saved):
        obj.load_state_dict(value)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """Every distinct torch.Generator a prepared loader, its samplers or dataset draw from."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "batch_sampler", None)
    owners = [loader, getattr(loader, "sampler", None), batch_sampler, inner]
    owners += [getattr(o, "sampler", None) for o in (batch_sampler, inner)]
    owners.append(getattr(loader, "dataset", None))
    found: list[torch.Generator] = []
    candidates = [getattr(o, "generator", None) for o in owners]
    candidates.append(getattr(loader, "synchronized_generator", None))
    for gen in candidates:
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


class _Position:
    """Where a prepared loader's epoch stands; puts the loader back there on resume."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch: dict[str, Any] | None = None  # RNG and epoch counter before this epoch's iter
        self.yielded = 0
        self.resume: dict[str, Any] | None = None
        self.prepared_iter = True  # the next iter() takes the iterator made at prepare()

    @classmethod
    def attach(cls, loader: Any) -> _Position:
        existing = loader.__dict__.get(_TRACKER)
        if existing is not None:
            return existing  # type: ignore[no-any-return]
        _patch_iter(type(loader))
        position = cls(loader)
        loader.__dict__[_TRACKER] = position
        return position

    def snapshot(self) -> dict[str, Any]:
        return {
            "global": rng_snapshot(),
            "loader": [g.get_state() for g in loader_generators(self.loader)],
            "iteration": getattr(self.loader, "iteration", 0),
        }

    def restore(self, snap: dict[str, Any]) -> None:
        rng_restore(snap["global"])
        for gen, value in zip(loader_generators(self.loader), snap["loader"]):
            gen.set_state(torch.as_tensor(value, dtype=torch.uint8).cpu())
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = int(snap["iteration"])

    def state(self) -> dict[str, Any]:
        now, yielded = self.snapshot(), self.yielded
        if yielded >= _length(self.loader) > 0:
            # The epoch's last batch: the loop ends the epoch at its next step, and the
            # loader counts it then; a resume starts the next epoch.
            now["iteration"] += 1
            yielded = -1
        return {"epoch": self.epoch, "yielded": yielded, "now": now}

    def resume_from(self, saved: dict[str, Any], rng: dict[str, Any]) -> None:
        self.resume = saved
        self.restore(saved["now"])  # an epoch boundary: the next epoch starts from here
        epoch = saved["epoch"]
        if epoch is not None and (saved["yielded"] < 0 or not epoch.get("first_iter", True)):
            self._next_iter_draws_its_seed()

    def _next_iter_draws_its_seed(self) -> None:
        """Drop the iterator a StatefulDataLoader made at ``prepare()`` (for its state_dict).

        The first iter() of a process takes that iterator, whose seed was drawn then; every
        later iter() makes a new one and draws its seed from the global RNG. A resume into
        a later epoch must draw as that epoch did, or the RNG (dropout) and the workers'
        seeds differ from the uninterrupted run's.
        """
        base = getattr(self.loader, "base_dataloader", None)
        if base is not None and hasattr(base, "load_state_dict"):
            base.load_state_dict({})  # torchdata: forget the iterator, load nothing
        self.prepared_iter = False

    def iterate(self, original: Any) -> Iterator[Any]:
        resume, self.resume = self.resume, None
        if resume is not None and resume["epoch"] is not None and resume["yielded"] > 0:
            yield from self._replay(original, resume)
            return
        first, self.prepared_iter = self.prepared_iter, False
        self.epoch, self.yielded = {**self.snapshot(), "first_iter": first}, 0
        for batch in original(self.loader):
            self.yielded += 1
            yield batch
        self.yielded = -1  # finished: the saved "now" is where the next epoch starts

    def _replay(self, original: Any, resume: dict[str, Any]) -> Iterator[Any]:
        # The same order from the same generators and epoch counter; the batches already
        # trained on are drawn and dropped, then every RNG is set back to the save's moment.
        self.restore(resume["epoch"])
        it = original(self.loader)
        self.prepared_iter = False
        for n in range(resume["yielded"]):
            if next(it, _END) is _END:
                raise ValueError(
                    f"resuming a loader at batch {resume['yielded']}: this run's loader ends "
                    f"after {n} batches"
                )
        self.epoch, self.yielded = resume["epoch"], resume["yielded"]
        self.restore(resume["now"])
        for batch in it:
            self.yielded += 1
            yield batch
        self.yielded = -1


_END = object()


def _length(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError:  # an iterable dataset without a length: its end is seen, not counted
        return 0


def _patch_iter(cls: type) -> None:
    """``cls.__iter__`` goes through the loader's _Position when it has one, as before otherwise."""
    original = cls.__dict__.get("__iter__") or getattr(cls, "__iter__")  # noqa: B009
    if getattr(original, "snapstate", False):
        return

    def __iter__(self: Any) -> Iterator[Any]:
        position = self.__dict__.get(_TRACKER)
        if position is None:
            return original(self)  # type: ignore[no-any-return]
        return position.iterate(original)  # type: ignore[no-any-return]

    __iter__.snapstate = True  # type: ignore[attr-defined]
    setattr(cls, "__iter__", __iter__)  # noqa: B010 - the loader's own class, once

"""The interface every checkpointing method implements, and the registry the harness picks from."""

from __future__ import annotations

import functools
import os
import queue
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from snapstate.bench.measure import now


class BenchTrainer(Protocol):
    """What the harness drives, in any framework: data-parallel training one step at a time.

    torch.distributed (gloo) is up before a trainer is built, on every framework, so methods
    and snapstate's adapters can use its collectives beside the framework's own.
    """

    rank: int
    world: int
    step: int
    epoch: int

    def train_step(self) -> float:
        """One optimizer step on this rank's batch; the loss (the same on every rank)."""

    def unique_state_bytes(self) -> int:
        """Bytes of one copy of the model and optimizer state."""

    def param_count(self) -> int: ...

    def final_params(self) -> dict[str, Any]:
        """The model's weights by stable name, as numpy arrays, for the bitwise resume check."""


@dataclass(frozen=True)
class MethodInfo:
    """What a method is, for the report: format, what it saves, who writes, how it resumes."""

    name: str
    framework: str
    format: str
    saves: tuple[str, ...]
    asynchronous: bool
    writers: str
    resume_note: str
    fsynced: bool = True  # done only once the bytes are on stable storage

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Pending:
    """One save in flight: when it was called and when its bytes became durable."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.finished: float | None = None
        self.error: BaseException | None = None
        self.extra: dict[str, Any] = {}
        self._event = threading.Event()

    def finish(self, error: BaseException | None = None) -> None:
        self.finished = now()
        self.error = error
        self._event.set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"save did not finish within {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"background save failed: {self.error!r}") from self.error

    @property
    def save_s(self) -> float:
        assert self.finished is not None, "save not finished"
        return self.finished - self.started


class Method(ABC):
    """A way to checkpoint: ``save`` returns when training may go on; ``wait`` until durable."""

    info: ClassVar[MethodInfo]

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._pending: Pending | None = None

    @classmethod
    def unavailable(cls, world: int = 1) -> str | None:
        """Why this method cannot run here on ``world`` ranks, or None.

        Asked in the harness's process, which may lack the framework: a subclass checks what
        it needs beyond its framework's environment without importing the framework.
        """
        from snapstate.bench.frameworks import unavailable

        return unavailable(cls.info.framework)

    def prepare(self, trainer: Any) -> None:
        """Set-up a user does once before training (a trainer's own objects), off the clock."""
        return None

    def save(self, trainer: Any, path: Path) -> Pending:
        pending = Pending(now())
        # A new save waits for the previous one; that wait is training time lost, so it counts.
        self.wait()
        self._start(trainer, path, pending)
        self._pending = pending
        return pending

    @abstractmethod
    def _start(self, trainer: Any, path: Path, pending: Pending) -> None:
        """Write (or stage and hand off) a checkpoint; call ``pending.finish`` when durable."""

    def wait(self, timeout: float | None = 3600.0) -> None:
        if self._pending is not None:
            self._pending.wait(timeout)
            self._pending = None

    @abstractmethod
    def load(self, trainer: Any, path: Path) -> None:
        """Restore what this method saved into the trainer, in place."""

    def owner(self, relpath: str) -> int:
        """Which rank wrote the file at ``relpath`` (inside one checkpoint)."""
        return 0

    def describe(self) -> dict[str, Any]:
        return self.info.to_dict()

    def close(self) -> None:
        self.wait()


METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method selectable by its ``info.name`` (TensorFlow, Chainer …)."""
    METHODS[cls.info.name] = cls
    return cls


def method_names() -> list[str]:
    return list(METHODS)


def get_method(name: str) -> type[Method]:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (or ``path`` itself): every method is timed to durable."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def start_snapstate_save(
    state: dict[str, Any], path: Path, pending: Pending, asynchronous: bool
) -> None:
    """``ss.save`` (finished here) or ``ss.async_save`` (finished by a watcher thread)."""
    import snapstate as ss

    if not asynchronous:
        pending.extra.update(result_timings(ss.save(state, str(path))))
        pending.finish()
        return
    handle = ss.async_save(state, str(path))
    watch(functools.partial(finish_when_done, handle, pending))


class SnapstateAdapterMethod(Method):
    """snapstate over an integration's ``stateful(model, optimizer)`` plus the data position.

    For trainers with ``model``, ``optimizer``, ``step``, ``epoch`` and ``position``
    (TensorFlow, Chainer); ``integration`` names the adapter module, imported only here.
    """

    integration: ClassVar[str]

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._state: dict[str, Any] | None = None

    def state(self, trainer: Any) -> dict[str, Any]:
        """Built once, so its structure (and snapstate's plan) stays the same between saves."""
        import importlib

        if self._state is None:
            stateful = importlib.import_module(self.integration).stateful
            self._state = {"train": stateful(trainer.model, trainer.optimizer)}
        self._state.update(step=trainer.step, epoch=trainer.epoch, position=trainer.position)
        return self._state

    def _start(self, trainer: Any, path: Path, pending: Pending) -> None:
        start_snapstate_save(self.state(trainer), path, pending, self.info.asynchronous)

    def load(self, trainer: Any, path: Path) -> None:
        import snapstate as ss

        state = self.state(trainer)
        ss.load(state, str(path))
        trainer.step, trainer.epoch = int(state["step"]), int(state["epoch"])
        trainer.position = int(state["position"])

    def owner(self, relpath: str) -> int:
        return snapstate_owner(relpath)


_watched: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_watcher: list[threading.Thread] = []
_watcher_lock = threading.Lock()


def watch(wait_and_finish: Callable[[], None]) -> None:
    """Run ``wait_and_finish`` (wait for an async save, then finish its Pending) on one
    long-lived thread per process.

    A new thread per save cost the training thread 2-4 ms to start on 2 busy cores, which
    was charged to the method's blocking time; DCP's future takes a callback instead.
    Saves complete in the order they start, so one thread waiting in turn is on time.
    """
    with _watcher_lock:
        if not _watcher:
            _watcher.append(threading.Thread(target=_watch_all, daemon=True, name="bench-watch"))
            _watcher[0].start()
    _watched.put(wait_and_finish)


def _watch_all() -> None:
    while True:
        job = _watched.get()
        job()
        del job  # a finished save's tensors are not kept alive while idle


def finish_when_done(handle: Any, pending: Pending) -> None:
    """Record when a snapstate handle completes (wait() only waits, no collective runs here)."""
    try:
        pending.extra.update(result_timings(handle.wait()))
    except BaseException as e:  # recorded and re-raised by Pending.wait on the training thread
        pending.finish(e)
        return
    pending.finish()


def result_timings(result: Any) -> dict[str, Any]:
    """The phases snapstate timed itself (blocking, persist, commit), kept next to ours."""
    out = {
        k: getattr(result, k)
        for k in ("blocking_s", "persist_s", "commit_s", "total_s")
        if hasattr(result, k)
    }
    timings = getattr(result, "timings", None)
    if isinstance(timings, dict):
        out.update({k: v for k, v in timings.items() if isinstance(v, int | float)})
    return out


def snapstate_owner(relpath: str) -> int:
    """The rank that wrote a snapstate file: shards are r<rank>-<n>.safetensors, the rest rank 0."""
    m = re.search(r"(?:^|/)r(\d+)[-.]", relpath)
    return int(m.group(1)) if m else 0

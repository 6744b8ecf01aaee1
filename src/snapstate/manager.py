"""CheckpointManager: numbered steps under a root, auto-resume from the latest valid one,
retention, and a lock so that two managers never write the same root.

The manager stays thin: saving, loading and validation live in the engine; retention rules
are a pure function (``retention.py``) and the lock has its own module (``lock.py``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import replace
from typing import Any

from snapstate import api
from snapstate.collective.coordinator import Coordinator, default_coordinator, gather_within
from snapstate.engine.handle import SaveOutcome, SaveResult
from snapstate.engine.inflight import SaveSlot
from snapstate.engine.options import INCREMENTAL_COMPRESSED, SaveOptions, with_keywords
from snapstate.engine.reuse import prior_from_manifest
from snapstate.engine.verify import read_manifest
from snapstate.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateRestoreError,
    UnsupportedFormatError,
)
from snapstate.format.manifest import MANIFEST
from snapstate.format.validation import STEP_NAME
from snapstate.lock import RootLock
from snapstate.planning.incremental import Reuse
from snapstate.references import SET_ASIDE, prune, references_of, steps_holding, sweep, uncommit
from snapstate.retention import steps_to_delete
from snapstate.storage.base import Storage, capabilities, storage_for

log = logging.getLogger("snapstate")
STEP_DIR = re.compile(rf"^{STEP_NAME.pattern}$")
SET_ASIDE_DIR = re.compile(r"^step-\d{9,}\.corrupt(\.\d+)?$")  # see _set_aside


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


class CheckpointManager:
    """Checkpoints of one training run under ``root/step-000000100/``.

    ``keep_last`` newest and every ``keep_every``-th step are kept; others are deleted only
    after a newer checkpoint has committed. ``save`` returns a SaveOutcome: the SaveHandle
    after staging with ``async_save=True``, else the SaveResult; at most one save is in flight
    and the next ``save`` waits for it. ``options`` are the SaveOptions of every save; ``timeout`` (seconds, the
    options' field of that name, a ValueError if it contradicts them) bounds every wait for
    the other ranks, in saves and in ``restore``.

    ``incremental=True`` (local file systems only, without compression): a chunk whose bytes
    equal those of the same chunk in the previous committed step is referenced, not written
    again (``docs/incremental.md``); retention keeps every file a retained step references.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        *,
        timeout: float | None = None,
        process_group: Any = None,
        options: SaveOptions | None = None,
        incremental: bool = False,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep everything)")
        if incremental and options is not None and options.compression is not None:
            raise ValueError(INCREMENTAL_COMPRESSED)
        self.storage: Storage = storage_for(root)
        # A reference names a file of another step; only a backend that can tell whether a
        # path resolves outside its root (local file systems) lets a load check one.
        if incremental and capabilities(self.storage).link_check is None:
            raise ValueError(
                f"incremental saves are local-only for now: {self.storage!r} is not a local"
                " file system (object stores and tiers cannot hold references between steps yet)"
            )
        self.incremental = incremental
        # step directory -> the files of other steps its manifest references (manifests do
        # not change once committed; a step saved again or deleted is dropped from it)
        self._references: dict[str, frozenset[str]] = {}
        self._given_storage = not isinstance(root, (str, os.PathLike))
        self.root = os.fspath(root) if isinstance(root, (str, os.PathLike)) else self.storage.root
        self.keep_last, self.keep_every, self.async_save = keep_last, keep_every, async_save
        self.process_group = process_group
        self.options = with_keywords(options, timeout=timeout)  # a ValueError if they disagree
        self.coord: Coordinator = default_coordinator(process_group)
        self.corrupt_steps: dict[int, str] = {}  # steps skipped by restore(), with the reason
        self._saves = SaveSlot()  # this manager's save in flight, for retention after it
        self._lock = RootLock(self.storage) if self.coord.rank == 0 else None
        if self._lock is not None:
            self.storage.makedirs()
            self._lock.acquire()
            self._sweep()

    # -- queries -----------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(
            s for s, name in self._step_dirs() if self.storage.exists(f"{name}/{MANIFEST}")
        )

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> str | Storage:
        """Where ``step`` lives: a path or URL, or a child Storage when a Storage was given."""
        if self._given_storage:
            return self.storage.child(step_dir(step))
        return (
            os.path.join(self.root, step_dir(step))
            if "://" not in self.root
            else f"{self.root.rstrip('/')}/{step_dir(step)}"
        )

    # -- save / restore ----------------------------------------------------------
    def save(self, step: int, state: Any) -> SaveOutcome:
        """Checkpoint ``state`` as ``step``: an async manager returns the SaveHandle after
        staging, a blocking one the SaveResult once committed; ``wait()`` gives it on both."""
        self.wait()
        self._refuse_referenced(step)
        self._references.pop(step_dir(step), None)
        options = self.options
        if self.incremental:
            options = replace(options, incremental=self._reuse_for(step))
        kwargs = {"step": step, "process_group": self.process_group, "options": options}
        if not self.async_save:
            result = api.save(state, self.path(step), **kwargs)
            self._apply_retention()
            return result
        return self._saves.start(lambda: api.async_save(state, self.path(step), **kwargs))

    def restore(self, state: Any, step: int | None = None, *, strict: bool = True) -> int | None:
        """Load ``step`` (default: the latest valid one) into ``state``; None if there is none.

        A latest checkpoint that fails validation is reported (logged, and kept in
        ``corrupt_steps``) and the one before it is used; an explicit ``step`` must load.
        A step found damaged (torn, truncated, missing files: not merely incompatible with
        ``state``) is set aside, so that training can save that step again and retention and
        ``latest_step`` ignore it; its bytes are kept for inspection (``_set_aside``).
        """
        self.wait()
        if step is not None:
            api.load(state, self.path(step), strict=strict, **self._load_options())
            return step
        steps = (
            self.steps()
            if self.coord.world_size == 1
            else gather_within(self.coord, self.steps(), self.options.timeout)[0]
        )
        # rank 0's listing: every rank tries the same steps in the same order
        for candidate in reversed(steps):
            error, damaged = self._try_load(state, candidate, strict)
            if error is None:
                return candidate
            self.corrupt_steps[candidate] = error
            log.warning(
                "snapstate: checkpoint step %d is not usable (%s); trying the previous one",
                candidate,
                error,
            )
            if damaged:
                self._set_aside(candidate)
        return None

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight (raising its error once), then apply retention."""
        result = self._saves.settle()
        if result is not None:
            self._apply_retention()
        return result

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------
    def _reuse_for(self, step: int) -> Reuse:
        """What an incremental save of ``step`` may reference: the newest earlier committed
        step's chunks, from its manifest (every rank reads it: no bytes of old files)."""
        name = step_dir(step)
        earlier = [s for s in self.steps() if s < step]
        if not earlier:
            return Reuse(name)
        prior = step_dir(earlier[-1])
        try:  # its files are there with their sizes, or a reference could never commit
            manifest = read_manifest(self.storage.child(prior))
        except CheckpointError as exc:  # a damaged previous step: write everything
            log.warning("snapstate: step %d not usable as a base (%s)", earlier[-1], exc)
            return Reuse(name)
        return prior_from_manifest(manifest, prior, name)

    def _refuse_referenced(self, step: int) -> None:
        """A save must not clear a step directory whose files committed steps reference."""
        name = step_dir(step)
        if not self.storage.exists(name):
            return
        if self._held_for_others(step):
            raise CheckpointError(
                f"cannot save step {step}: {self.root}/{name} holds files that later committed"
                " steps reference (incremental saves); save under another step number"
            )

    def _try_load(self, state: Any, step: int, strict: bool) -> tuple[str | None, bool]:
        """Load on every rank; all ranks agree on success so they pick the same step.

        Returns the first failure (None on success) and whether any rank found the step
        damaged rather than incompatible or of a newer format. A Stateful object that refused
        the state (StateRestoreError: the load was undone) is raised on every rank instead:
        the step is fine, and an older one would be refused the same way.
        """
        refused: StateRestoreError | None = None
        try:
            api.load(state, self.path(step), strict=strict, **self._load_options())
            outcome: tuple[str, bool, bool] = ("", False, False)
        except StateRestoreError as exc:
            refused, outcome = exc, (f"{type(exc).__name__}: {exc}", False, True)
        except (CheckpointError, OSError) as exc:
            outcome = (f"{type(exc).__name__}: {exc}", _is_damage(exc), False)
        # bounded: a rank that stopped is a CheckpointTimeoutError, not a wait for the group's
        gathered = gather_within(self.coord, outcome, self.options.timeout)
        if refused is not None:
            raise refused
        if any(was_refused for _, _, was_refused in gathered):
            rank = next(r for r, o in enumerate(gathered) if o[2])
            raise StateRestoreError(f"on rank {rank}: {gathered[rank][0]}", key="")
        failures = [o for o in gathered if o[0]]
        if not failures:
            return None, False
        return failures[0][0], any(bool(damaged) for _, damaged, _ in failures)

    def _load_options(self) -> dict[str, Any]:
        return {"process_group": self.process_group, "timeout": self.options.timeout}

    def _set_aside(self, step: int) -> None:
        """Take a damaged step out of the run, keeping its bytes: ``step-N.corrupt`` on local
        disks (one rename), else its manifest moved to ``manifest.json.corrupt``."""
        if self.coord.rank != 0:
            return
        name = step_dir(step)
        shared = self._held_for_others(step)
        self._references.pop(name, None)
        try:
            renames = capabilities(self.storage).renames
            if renames is not None and not shared:
                target = _free_name(self.storage, f"{name}.corrupt")
                renames.rename(name, target)
                self.storage.sync_dir()
            else:
                manifest = f"{name}/{MANIFEST}"
                if self.storage.exists(manifest):
                    self.storage.write_atomic(
                        f"{name}/{SET_ASIDE}", self.storage.read_bytes(manifest)
                    )
                    self.storage.remove(manifest)
                target = f"{name}/{SET_ASIDE}"
        except (OSError, CheckpointError) as exc:
            log.warning("snapstate: could not set aside damaged step %d: %s", step, exc)
            return
        log.warning("snapstate: damaged checkpoint step %d set aside as %s", step, target)
        self._sweep()  # files only the set-aside step referenced may go now

    def _step_dirs(self) -> list[tuple[int, str]]:
        return [
            (int(m.group(1)), name)
            for name in self.storage.listdir()
            if (m := STEP_DIR.match(name))
        ]

    def _held_for_others(self, step: int) -> bool:
        """Whether another committed step references files in ``step``'s directory."""
        others = [step_dir(s) for s in self.steps() if s != step]
        return step_dir(step) in steps_holding(self._referenced(others))

    def _sweep(self) -> None:
        """Leftovers of interrupted saves (and of deletions interrupted after the manifest
        went) go, except files that committed steps reference."""
        committed = [step_dir(s) for s in self.steps()]
        try:
            keep = self._referenced(committed)
        except OSError as exc:  # nothing is deleted on a guess
            log.warning("snapstate: leftovers kept, the manifests could not be read: %s", exc)
            return
        sweep(self.storage, committed, keep)

    def _referenced(self, names: list[str]) -> frozenset[str]:
        """Files of other steps that the steps ``names`` or a set-aside step reference: the
        bytes of a set-aside step are kept for inspection, its shared ones included."""
        aside = [n for n in self.storage.listdir() if SET_ASIDE_DIR.match(n)]
        for name in [*names, *aside]:
            if name not in self._references:
                self._references[name] = references_of(self.storage, name)
        return frozenset().union(*(self._references[n] for n in [*names, *aside]))

    def _apply_retention(self) -> None:
        if self.coord.rank != 0:
            return
        committed = self.steps()
        doomed = steps_to_delete(committed, self.keep_last, self.keep_every)
        if not doomed:
            return
        kept = [step_dir(s) for s in committed if s not in doomed]
        try:
            keep = self._referenced(kept)  # read before anything goes
        except OSError as exc:  # nothing is deleted on a guess
            log.warning("snapstate: retention skipped, the manifests could not be read: %s", exc)
            return
        for step in doomed:
            uncommit(self.storage, step_dir(step))  # manifest gone = invisible, first
            self._references.pop(step_dir(step), None)
        for step in doomed:  # then every byte no retained step references
            prune(self.storage, step_dir(step), keep)
        sweep(self.storage, kept, keep)  # steps deleted before whose files nobody needs now


def _is_damage(exc: BaseException) -> bool:
    """Bytes on disk that are wrong or gone (set aside), not a mismatch with the caller's state
    or a format this version cannot read (kept: a newer snapstate may load it)."""
    if isinstance(exc, UnsupportedFormatError):
        return False
    return isinstance(exc, (CorruptCheckpointError, CheckpointNotFoundError, FileNotFoundError))


def _free_name(storage: Storage, name: str) -> str:
    """``name``, or ``name.1``, ``name.2``... if a step was set aside under it before."""
    taken = set(storage.listdir())
    candidate, n = name, 0
    while candidate in taken:
        n += 1
        candidate = f"{name}.{n}"
    return candidate

"""The files the steps of one root share (incremental saves): which committed step needs which
file, what retention may delete while retained steps reference files of a deleted step, and
which steps a damaged file breaks.

Files are named root-relative (``step-000000010/shards/r00000-000.safetensors``). A step is
deleted manifest first (the commit point), then only its files no committed manifest needs:
a SIGKILL between the two leaves a directory without a manifest whose referenced files are
kept, and the next sweep finishes the job. Such a directory stays until nothing references it.
"""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from snapstate.engine.verify import read_manifest, verify_checkpoint
from snapstate.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from snapstate.format.manifest import MANIFEST, REFERENCE_VERSION
from snapstate.planning.incremental import resolve, step_number
from snapstate.storage.base import Storage, read_capped

log = logging.getLogger("snapstate")
SET_ASIDE = f"{MANIFEST}.corrupt"  # a set-aside step's manifest, kept in place
_HEAD = 48  # bytes enough to see `{"format":"snapstate","version":4`
_VERSION = re.compile(rb'"version":(\d+)')  # 4 or later may reference (5: grids as well)


def needed_files(storage: Storage, name: str) -> frozenset[str]:
    """Root-relative files the committed step ``name`` needs: its own and those it references.

    A manifest that does not validate needs nothing known (it is damaged, never loadable), but
    its own files are kept with it while it stays committed. Any other failure to read it (an
    I/O error) is raised: nothing may be deleted on a guess."""
    try:
        manifest = read_manifest(storage.child(name), check_files=False)
    except (CorruptCheckpointError, CheckpointNotFoundError):
        return frozenset()
    return frozenset(resolve(name, f) for f in manifest.files)


def references_of(storage: Storage, name: str) -> frozenset[str]:
    """The files of other steps that the committed step ``name`` references (none unless its
    manifest is format version 4 or later: the first bytes tell, the rest is parsed only then)."""
    try:  # a regular file only: a FIFO would block
        head = read_capped(storage, f"{name}/{MANIFEST}", _HEAD)[:_HEAD]
    except FileNotFoundError:  # no manifest (any more): no step, nothing referenced
        return frozenset()
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ELOOP, errno.ENXIO):  # not a regular file: damaged
            return frozenset()
        raise
    version = _VERSION.search(head)
    if version is None or int(version.group(1)) < REFERENCE_VERSION:
        return frozenset()
    return frozenset(f for f in needed_files(storage, name) if not f.startswith(name + "/"))


def referenced(storage: Storage, names: Iterable[str]) -> frozenset[str]:
    """Every file of another step that one of the committed steps ``names`` references."""
    return frozenset().union(*(references_of(storage, n) for n in names))


def steps_holding(files: Iterable[str]) -> frozenset[str]:
    """The step directories that the root-relative ``files`` lie in."""
    return frozenset(f.split("/", 1)[0] for f in files)


def uncommit(storage: Storage, name: str) -> None:
    """Remove the step's manifest, the commit point: it is no step any more."""
    storage.remove(f"{name}/{MANIFEST}")
    storage.sync_dir(name)


def prune(storage: Storage, path: str, keep: frozenset[str]) -> None:
    """Delete ``path`` (a step directory of no committed step) except the files in ``keep``
    and the folders above them; the whole tree when it holds none of them."""
    if not any(k.startswith(path + "/") for k in keep):
        storage.remove_tree(path)
        try:
            storage.remove(path)  # a plain file: remove_tree leaves it
        except OSError:  # best effort, as remove_tree: a later sweep tries again
            pass
        return
    for entry in storage.listdir(path):
        child = f"{path}/{entry}"
        if child not in keep:
            prune(storage, child, keep)


def sweep(storage: Storage, committed: Iterable[str], keep: frozenset[str]) -> None:
    """Delete every step directory without a manifest (none set aside), keeping ``keep``:
    leftovers of interrupted saves, and steps retention deleted whose files were referenced
    (now gone when nothing references them any more)."""
    live = set(committed)
    for name in storage.listdir():
        if step_number(name) is None or name in live or storage.exists(f"{name}/{SET_ASIDE}"):
            continue
        if storage.exists(f"{name}/{MANIFEST}"):  # committed since the listing: not ours
            continue
        log.info("snapstate: removing %s (no manifest), keeping referenced files", name)
        prune(storage, name, keep)


@dataclass(frozen=True)
class StepCheck:
    """One step's verification: ``problem`` None when every byte verified; ``file`` the
    root-relative file found damaged or missing, when the problem lies in one."""

    step: str
    problem: str | None = None
    file: str | None = None


def verify_steps(storage: Storage) -> list[StepCheck]:
    """Verify every committed step of the root (every step a damaged shared file breaks
    fails, since each verifies every file it needs)."""
    checks = []
    for name in sorted(n for n in storage.listdir() if step_number(n) is not None):
        if not storage.exists(f"{name}/{MANIFEST}"):
            continue
        try:
            verify_checkpoint(storage.child(name))
        except CorruptCheckpointError as exc:
            file = exc.file
            if file is not None and (file.endswith(MANIFEST) or file.startswith("/")):
                file = None  # the manifest itself: this step's own problem
            checks.append(StepCheck(name, str(exc), None if file is None else resolve(name, file)))
            continue
        except (CheckpointError, OSError) as exc:
            checks.append(StepCheck(name, str(exc)))
            continue
        checks.append(StepCheck(name))
    return checks


def damaged_files(checks: list[StepCheck]) -> dict[str, list[str]]:
    """Each damaged file and the steps whose verification it broke."""
    out: dict[str, list[str]] = {}
    for c in checks:
        if c.file is not None:
            out.setdefault(c.file, []).append(c.step)
    return out

"""What a rank's save copies where, decided once per plan (pure: no tensor is touched).

An unchanged state is saved with the same cached plan save after save, so the per-chunk
decisions (which chunks share one batched copy, at which offsets, with which dtype and shape)
are made here once and kept with the plan; each save then only looks its tensors up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from snapstate.format.dtypes import dtype_from_name
from snapstate.planning.items import PlacedItem, Placement, RankPlan, WriteItem
from snapstate.state.views import same_size_int

# Dtypes whose copy kernels copy bits as they are (others go through an integer view: a
# bool's copy would turn a byte of 2 into 1).
BATCH_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.complex64,
        torch.complex128,
    }
)


@dataclass(frozen=True, eq=False)
class RunLayout:
    """Where each tensor of a run goes in the run's range of ``nbytes``."""

    offsets: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int

    def split(self, parts: int) -> list[int]:
        """Indices cutting the run into about ``parts`` spans of equal bytes (ends included)."""
        cuts, goal = [0], self.nbytes / parts
        for i, offset in enumerate(self.offsets):
            if i and offset >= goal * len(cuts) and len(cuts) < parts:
                cuts.append(i)
        return [*cuts, len(self.offsets)]


@dataclass(frozen=True, eq=False)
class Run:
    """Consecutive chunks of one file, staged by one batched copy into one range.

    ``keys`` is set when every chunk is a whole tensor of one dict (``rank_local`` says which):
    a save then takes the tensors by key instead of slicing views. A chunk whose dtype has no
    bitwise batched copy (bool, uint32, float8...) is copied as the integer of its size: its
    index is in ``retyped`` and ``layout.dtypes`` holds that integer type.
    """

    placed: tuple[PlacedItem, ...]
    layout: RunLayout
    batchable: bool  # every chunk has a bitwise batched copy (as itself or retyped)
    keys: tuple[str, ...] | None
    rank_local: bool
    retyped: tuple[int, ...]
    # what the writer records per chunk: (chunk, first byte, end byte in the run, last part)
    parts: tuple[tuple[PlacedItem, int, int, bool], ...]


@dataclass(frozen=True, eq=False)
class Single:
    """A chunk staged on its own: larger than a run allows, so in pieces of at most a slab."""

    placed: PlacedItem


Step = Run | Single

T = TypeVar("T")


class _BuiltOnce(Generic[T]):
    """Values built once per (objects, key), the objects compared by identity: they are held,
    so that their ids stay their own; past ``limit`` entries (objects of earlier plans) all go."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: dict[tuple[int, ...], tuple[tuple[object, ...], dict[Hashable, T]]] = {}
        self._lock = threading.Lock()

    def get(self, objects: Sequence[object], key: Hashable, build: Callable[[], T]) -> T:
        ids = tuple(map(id, objects))
        with self._lock:
            known = self._known.get(ids)
            if known is None or any(a is not b for a, b in zip(known[0], objects)):
                if len(self._known) >= self.limit:
                    self._known.clear()
                known = self._known[ids] = (tuple(objects), {})
            value = known[1].get(key)
            if value is None:
                value = known[1][key] = build()
            return value


_steps: _BuiltOnce[list[Step]] = _BuiltOnce(limit=8)


def stage_steps(rank_plan: RankPlan, piece_bytes: int, run_chunk_bytes: int) -> list[Step]:
    """The plan's chunks in file order: runs of chunks up to ``run_chunk_bytes`` each, whose
    span fits ``piece_bytes``, and single chunks. Built once per plan and sizes."""
    return _steps.get(
        (rank_plan,),
        (piece_bytes, run_chunk_bytes),
        lambda: _make_steps(rank_plan, piece_bytes, run_chunk_bytes),
    )


def _make_steps(rank_plan: RankPlan, piece_bytes: int, run_chunk_bytes: int) -> list[Step]:
    steps: list[Step] = []
    limit = min(run_chunk_bytes, piece_bytes)
    for file in rank_plan.files:
        run: list[PlacedItem] = []
        for placed in file.items:
            fits = 0 < placed.item.nbytes <= limit
            if run and not (fits and placed.end - run[0].start <= piece_bytes):
                steps.append(make_run(run))
                run = []
            if fits:
                run.append(placed)
            else:
                steps.append(Single(placed))
        if run:
            steps.append(make_run(run))
    return steps


def copy_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a batched copy moves this one's bits as (None: no batched copy)."""
    return dtype if dtype in BATCH_DTYPES else same_size_int(dtype.itemsize)


def make_run(placed: list[PlacedItem]) -> Run:
    base = placed[0].start
    dtypes = [dtype_from_name(p.item.dtype) for p in placed]
    copies = [copy_dtype(d) for d in dtypes]
    layout = RunLayout(
        offsets=tuple(p.start - base for p in placed),
        dtypes=tuple(c or d for c, d in zip(copies, dtypes)),
        shapes=tuple(tuple(p.item.box.sizes) for p in placed),
        nbytes=placed[-1].end - base,
    )
    local = {p.item.placement is Placement.RANK_LOCAL for p in placed}
    whole = len(local) == 1 and all(_is_whole(p) for p in placed)
    return Run(
        placed=tuple(placed),
        layout=layout,
        batchable=None not in copies,
        keys=tuple(p.item.key for p in placed) if whole else None,
        rank_local=local == {True},
        retyped=tuple(i for i, (c, d) in enumerate(zip(copies, dtypes)) if c is not d),
        parts=tuple((p, p.start - base, p.end - base, True) for p in placed),
    )


_single_runs: _BuiltOnce[Run] = _BuiltOnce(limit=1 << 14)


def single_run(placed: PlacedItem) -> Run:
    """A run of this one chunk, built once (a save stages it again and again)."""
    return _single_runs.get((placed,), None, lambda: make_run([placed]))


def _is_whole(placed: PlacedItem) -> bool:
    item = placed.item
    return tuple(item.box.sizes) == tuple(item.shape) and not any(item.box.offsets)


# The chunks a rank witnesses (hashes for their writers) are in no file of its own: their
# runs are ranges of staging memory only, and their places carry this file name.
WITNESS_FILE = ""
_witness_steps: _BuiltOnce[list[Step]] = _BuiltOnce(limit=64)


def witness_steps(items: list[WriteItem], piece_bytes: int) -> list[Step]:
    """The chunks this rank witnesses in a save, packed into runs that fit ``piece_bytes``
    (larger ones alone). Built once per witnessed set: it repeats as the turns rotate."""
    return _witness_steps.get(items, piece_bytes, lambda: _make_witness_steps(items, piece_bytes))


def _make_witness_steps(items: list[WriteItem], piece_bytes: int) -> list[Step]:
    steps: list[Step] = []
    run: list[PlacedItem] = []
    for item in items:
        if not 0 < item.nbytes <= piece_bytes:
            steps.append(Single(PlacedItem(item, WITNESS_FILE, 0)))
            continue
        start = -(-run[-1].end // item.itemsize) * item.itemsize if run else 0
        if run and start + item.nbytes > piece_bytes:
            steps.append(make_run(run))
            run, start = [], 0
        run.append(PlacedItem(item, WITNESS_FILE, start))
    if run:
        steps.append(make_run(run))
    return steps

"""Persist: background threads write staged pieces to shard files, checksum them, fsync.

Every file is owned by one thread, which receives that file's pieces in order, so object
stores that only append get sequential writes and each chunk's blocks hash in one stream.
Copies, writes and hashing run in C and release the GIL, so training keeps its core.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from snapstate.engine.staging import StagedBytes
from snapstate.format.integrity import BlockHasher
from snapstate.planning.items import PlacedItem, RankPlan
from snapstate.storage.base import FileWriter, Storage

_STOP = object()


@dataclass
class PersistStats:
    bytes_written: int = 0
    write_s: float = 0.0
    # (file, start, end) -> xxh3 blocks
    digests: dict[tuple[str, int, int], list[str]] = field(default_factory=dict)


class RankWriter:
    """Writes one rank's planned files; ``submit`` pieces, then ``close`` to fsync and collect."""

    def __init__(
        self,
        storage: Storage,
        plan: RankPlan,
        block_bytes: int,
        threads: int = 1,
        hold: bool = False,
    ) -> None:
        self.storage = storage
        # An async save holds its pieces until staging ends (``flush``): on a few cores the
        # writer's copies and hashing would slow the staging copies that training waits for.
        self._held: list[tuple[PlacedItem, int, StagedBytes, bool]] | None = [] if hold else None
        self.block_bytes = block_bytes
        self.stats = PersistStats()
        self.error: BaseException | None = None
        self._aborted = False
        self._lock = threading.Lock()
        self._writers: dict[str, FileWriter] = {}
        self._hashers: dict[tuple[str, int, int], BlockHasher] = {}
        self._queues: list[queue.SimpleQueue] = [
            queue.SimpleQueue() for _ in range(max(1, threads))
        ]
        self._owner = {f.path: i % len(self._queues) for i, f in enumerate(plan.files)}
        self._files = plan.files
        # Each writer thread hands written pieces to its own hasher thread: hashing one piece
        # overlaps writing the next (both release the GIL), and each chunk still hashes in order.
        hash_queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self._queues]
        self._threads = [
            *(
                threading.Thread(
                    target=self._run, args=(q, h), name=f"snapstate-persist-{i}", daemon=True
                )
                for i, (q, h) in enumerate(zip(self._queues, hash_queues))
            ),
            *(
                threading.Thread(
                    target=self._run_hasher, args=(h,), name=f"snapstate-hash-{i}", daemon=True
                )
                for i, h in enumerate(hash_queues)
            ),
        ]
        try:
            for f in plan.files:
                writer = storage.open_writer(f.path, f.size)
                self._writers[f.path] = writer
                writer.write_at(memoryview(f.header), 0)
        except BaseException:
            self.abort()
            raise
        if self._held is None:
            self._start()

    def submit(
        self, placed: PlacedItem, offset_in_chunk: int, staged: StagedBytes, last: bool
    ) -> None:
        if self.error is not None:
            if staged.release:
                staged.release()
            raise self.error
        if self._held is not None:
            self._held.append((placed, offset_in_chunk, staged, last))
            return
        self._queues[self._owner[placed.file]].put((placed, offset_in_chunk, staged, last))

    def flush(self) -> None:
        """Hand the held pieces to the writer threads; from now on pieces go straight to them."""
        if self._held is None:
            return
        held, self._held = self._held, None
        for job in held:
            self._queues[self._owner[job[0].file]].put(job)
        self._start()  # only now: no writer thread competes with staging for a core

    def _start(self) -> None:
        for t in self._threads:
            if t.ident is None:  # not started yet
                t.start()

    def close(self) -> PersistStats:
        """Wait for all pieces, fsync and close every file; raise the first error (files removed)."""
        self.flush()
        self._start()  # also after an abort, so that join() below has threads to join
        for q in self._queues:
            q.put(_STOP)
        for t in self._threads:
            t.join()
        if self.error is not None:
            self.abort()
            raise self.error
        started = time.perf_counter()
        try:
            for writer in self._writers.values():
                writer.close(sync=True)
        except BaseException:
            self.abort()
            raise
        self.stats.write_s += time.perf_counter() - started
        return self.stats

    def abort(self) -> None:
        self._aborted = True  # queued pieces are dropped, not written
        held, self._held = self._held or [], None
        for _, _, staged, _ in held:  # never written: give their buffers back
            if staged.release:
                staged.release()
        for q in self._queues:  # threads drain (releasing staged buffers) and exit
            q.put(_STOP)
        for t in self._threads:  # before closing: no thread may write to a closed (reused) fd
            if t.ident is not None:
                t.join()
        for writer in self._writers.values():
            writer.abort()

    def _run(self, q: queue.SimpleQueue, hashes: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is _STOP:
                hashes.put(_STOP)
                return
            placed, offset, staged, last = job
            try:
                if self.error is None and not self._aborted:
                    self._write(placed, offset, staged)
            except BaseException as exc:  # noqa: BLE001 - surfaced on close(), i.e. on wait()
                self._fail(exc)
            hashes.put(job)  # the hasher releases the buffer once it is written and hashed

    def _run_hasher(self, q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is _STOP:
                return
            placed, _, staged, last = job
            try:
                if self.error is None:
                    self._hash(placed, staged, last)
            except BaseException as exc:  # noqa: BLE001 - surfaced on close(), i.e. on wait()
                self._fail(exc)
            finally:
                if staged.release:
                    staged.release()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.error = self.error or exc

    def _write(self, placed: PlacedItem, offset: int, staged: StagedBytes) -> None:
        if staged.ready:
            staged.ready()
        started = time.perf_counter()
        self._writers[placed.file].write_at(staged.data, placed.start + offset)
        with self._lock:
            self.stats.bytes_written += len(staged.data)
            self.stats.write_s += time.perf_counter() - started

    def _hash(self, placed: PlacedItem, staged: StagedBytes, last: bool) -> None:
        # an empty chunk starts where the next one does
        key = (
            placed.file,
            placed.start,
            placed.end,
        )
        hasher = self._hashers.setdefault(key, BlockHasher(self.block_bytes))
        hasher.update(staged.data)
        if last:
            self.stats.digests[key] = self._hashers.pop(key).finish()

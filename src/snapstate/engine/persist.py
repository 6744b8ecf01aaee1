"""Persist: background threads write staged pieces to shard files, checksum them, fsync.

Every file is owned by one thread, which receives that file's pieces in order, so object
stores that only append get sequential writes and each chunk's blocks hash in one stream.
Copies, writes and hashing run in C and release the GIL, so training keeps its core.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from snapstate.engine.compress import ChunkKey, CompressedFile, StoredChunk
from snapstate.engine.reuse import ReusingFile
from snapstate.engine.staging import StagedBytes
from snapstate.errors import CheckpointError, CheckpointIOError
from snapstate.format.integrity import BlockHasher
from snapstate.planning import incremental
from snapstate.planning.items import PlacedItem, RankPlan
from snapstate.state.views import GatheredBytes
from snapstate.storage.base import FileWriter, Storage, vectored_writer

_STOP = object()
_io_errors: dict[type[OSError], type[CheckpointIOError]] = {}


def as_checkpoint_error(exc: BaseException, root: str, doing: str = "saving") -> BaseException:
    """An OSError of a save (or a load: ``doing``) as a CheckpointIOError of the same kind
    (errno and path kept).

    Other exceptions, and OSErrors that already are CheckpointErrors, come back unchanged.
    """
    if not isinstance(exc, OSError) or isinstance(exc, CheckpointError):
        return exc
    kind = type(exc)
    cls = _io_errors.get(kind)
    if cls is None:
        builtin = kind.__module__ == "builtins" and kind is not OSError
        cls = (
            type(f"Checkpoint{kind.__name__}", (CheckpointIOError, kind), {})
            if builtin
            else CheckpointIOError
        )
        _io_errors[kind] = cls
    reason = exc.strerror or str(exc)
    err = cls(exc.errno, f"{reason} ({doing} {root})", exc.filename)
    err.__cause__ = exc
    return err


def write_gathered(writer: FileWriter, buffers: tuple[memoryview, ...], at: int) -> int:
    """Write ``buffers`` back to back from byte ``at``: one vectored write where the writer's
    class has one (``write_many``), else one ``write_at`` each. Returns the bytes written.

    A wrapper or subclass that changes ``write_at`` (to count or inject faults) gets every
    write through it, as ``engine/readorder.py`` does for reads.
    """
    vectored = vectored_writer(writer)
    if vectored is not None:
        return vectored.write_many(buffers, at)
    offset = at
    for buffer in buffers:
        writer.write_at(buffer, offset)
        offset += len(buffer)
    return offset - at


@dataclass(frozen=True)
class _Job:
    """Bytes to write at ``at`` in ``file``, and the chunks (or parts of chunks) they hold.

    ``parts`` lists (chunk, first byte, end byte in ``staged.data``, last part of the chunk):
    one part for a piece of a large chunk, several for a run of small chunks staged together.
    """

    file: str
    at: int
    staged: StagedBytes | GatheredBytes
    parts: tuple[tuple[PlacedItem, int, int, bool], ...]


@dataclass(frozen=True)
class _Decided:
    """An incremental save's job once hashed: what to write where (``buffers`` back to back
    from ``at``), and whether the job completed its file (then its header goes next)."""

    job: _Job
    at: int
    buffers: tuple[memoryview, ...]
    complete: bool


@dataclass
class PersistStats:
    bytes_written: int = 0
    write_s: float = 0.0  # in the writes, summed over writer threads
    sync_s: float = 0.0  # the final fsync of every file
    # (file, start, end) -> xxh3 blocks of the raw bytes
    digests: dict[tuple[str, int, int], list[str]] = field(default_factory=dict)
    # compressed saves: where each chunk was stored, and each file's real size
    stored: dict[ChunkKey, StoredChunk] = field(default_factory=dict)
    file_sizes: dict[str, int] = field(default_factory=dict)
    # incremental saves: each chunk's xxh3-128, the chunks referenced (not written) with the
    # earlier copy they reference, and the files not written at all (every chunk referenced)
    content: dict[ChunkKey, str] = field(default_factory=dict)
    reused: dict[ChunkKey, incremental.StoredChunk] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)


class RankWriter:
    """Writes one rank's planned files; ``submit`` pieces, then ``close`` to fsync and collect."""

    def __init__(
        self,
        storage: Storage,
        plan: RankPlan,
        block_bytes: int,
        threads: int = 1,
        hold: bool = False,
        compression: str | None = None,
        reuse: incremental.Reuse | None = None,
    ) -> None:
        self.storage = storage
        # incremental: each file's chunks hashed before they are written, unchanged ones
        # referenced; the header goes last, once the file's chunks are decided
        self._reusing = (
            {f.path: ReusingFile(f, block_bytes, reuse) for f in plan.files} if reuse else None
        )
        # compressed: each file's frames, written header first once the file is complete
        self._compressed = (
            {f.path: CompressedFile(f, block_bytes) for f in plan.files} if compression else None
        )
        # An async save holds its pieces until staging ends (``flush``): on a few cores the
        # writer's copies and hashing would slow the staging copies that training waits for.
        self._held: list[_Job] | None = [] if hold else None
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
        if self._held is None:
            self._open_files()
            self._start()

    def _open_files(self) -> None:
        """Open every file and write its header; an async save does it in the background."""
        try:
            for f in self._files:
                writer = self.storage.open_writer(f.path, f.size)
                self._writers[f.path] = writer
                if self._compressed is None and self._reusing is None:
                    # else its real header comes with its frames, or once its chunks are decided
                    writer.write_at(memoryview(f.header), 0)
        except BaseException:
            self.abort()
            raise

    def submit(
        self, placed: PlacedItem, offset_in_chunk: int, staged: StagedBytes, last: bool
    ) -> None:
        """One piece of a chunk, ``offset_in_chunk`` bytes into it (pieces come in order)."""
        parts = ((placed, 0, len(staged.data), last),)
        self._put(_Job(placed.file, placed.start + offset_in_chunk, staged, parts))

    def submit_run(
        self,
        parts: tuple[tuple[PlacedItem, int, int, bool], ...],
        staged: StagedBytes | GatheredBytes,
    ) -> None:
        """Whole consecutive chunks of one file, staged together as the bytes of their range;
        ``parts`` as in ``_Job``, the first starting at byte 0."""
        first = parts[0][0]
        self._put(_Job(first.file, first.start, staged, parts))

    def _put(self, job: _Job) -> None:
        if self.error is not None:
            if job.staged.release:
                job.staged.release()
            raise self.error
        if self._held is not None:
            self._held.append(job)
            return
        self._queues[self._owner[job.file]].put(job)

    def flush(self) -> None:
        """Hand the held pieces to the writer threads; from now on pieces go straight to them."""
        if self._held is None:
            return
        held, self._held = self._held, None
        try:
            self._open_files()  # here, not at construction: off the training thread
        except BaseException:
            for job in held:  # never written: give their buffers back
                if job.staged.release:
                    job.staged.release()
            raise
        for job in held:
            self._queues[self._owner[job.file]].put(job)
        self._start()  # only now: no writer thread competes with staging for a core

    def _start(self) -> None:
        for t in self._threads:
            if t.ident is None:  # not started yet
                t.start()

    def close(self, meanwhile: Callable[[PersistStats], None] | None = None) -> PersistStats:
        """Wait for all pieces, fsync and close every file; raise the first error (files removed).

        ``meanwhile`` runs on this thread while the files fsync, given the stats of the bytes
        written (their digests are final by then): the caller's next step (building the
        marker) overlaps the disk's wait instead of following it.
        """
        self.flush()
        self._start()  # also after an abort, so that join() below has threads to join
        for q in self._queues:
            q.put(_STOP)
        for t in self._threads:
            t.join()
        if self.error is None and self._compressed is not None:
            for path in list(self._compressed):  # files without chunks
                self._write_compressed(path)
        if self.error is None and self._reusing is not None:
            for path in list(self._reusing):  # files without chunks
                self._finish_reusing(path)
        if self.error is not None:
            self.abort()
            raise self.error
        started = time.perf_counter()
        failed: list[BaseException] = []

        def sync_all() -> None:
            try:
                for writer in self._writers.values():
                    writer.close(sync=True)
            except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
                failed.append(exc)

        if meanwhile is None:
            sync_all()
        else:
            syncer = threading.Thread(target=sync_all, name="snapstate-fsync", daemon=True)
            syncer.start()
            try:
                meanwhile(self.stats)
            except BaseException:
                syncer.join()
                self.abort()
                raise
            syncer.join()
        if failed:
            self.abort()
            raise failed[0]
        self.stats.sync_s = time.perf_counter() - started
        return self.stats

    def abort(self) -> None:
        self._aborted = True  # queued pieces are dropped, not written
        held, self._held = self._held or [], None
        for job in held:  # never written: give their buffers back
            if job.staged.release:
                job.staged.release()
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
            out: _Job | _Decided = job
            try:
                if self.error is None and not self._aborted:
                    if self._reusing is not None:
                        out = self._decide(
                            self._reusing[job.file], job
                        )  # written on the next thread
                    else:
                        self._write(job)
            except BaseException as exc:  # noqa: BLE001 - surfaced on close(), i.e. on wait()
                self._fail(exc)
            hashes.put(out)  # the hasher releases the buffer once it is written and hashed

    def _run_hasher(self, q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is _STOP:
                return
            staged = job.job.staged if isinstance(job, _Decided) else job.staged
            try:
                if self.error is not None or self._aborted:
                    pass
                elif isinstance(job, _Decided):  # incremental: hashed already, write it now
                    self._write_decided(job)
                elif self._reusing is None:
                    for i, (placed, begin, end, last) in enumerate(job.parts):
                        self._hash(placed, job.staged.part(i, begin, end), last)
            except BaseException as exc:  # noqa: BLE001 - surfaced on close(), i.e. on wait()
                self._fail(exc)
            finally:
                if staged.release:
                    staged.release()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.error = self.error or exc

    def _write(self, job: _Job) -> None:
        if job.staged.ready:
            job.staged.ready()
        started = time.perf_counter()
        writer, staged = self._writers[job.file], job.staged
        if self._compressed is not None:
            self._compress(self._compressed, job)
            nbytes = 0  # counted when the file is written
        elif isinstance(staged, GatheredBytes):
            nbytes = write_gathered(writer, staged.buffers, job.at)
        else:
            writer.write_at(staged.data, job.at)
            nbytes = len(staged.data)
        with self._lock:
            self.stats.bytes_written += nbytes
            self.stats.write_s += time.perf_counter() - started

    def _compress(self, compressed: dict[str, CompressedFile], job: _Job) -> None:
        """Encode the job's parts; the file goes out once its last chunk is encoded."""
        pending = compressed[job.file]
        for i, (placed, begin, end, last) in enumerate(job.parts):
            if pending.add(placed, job.staged.part(i, begin, end), last):
                self._write_compressed(job.file)

    def _write_compressed(self, path: str) -> None:
        pending = self._compressed.pop(path, None) if self._compressed is not None else None
        if pending is None:
            return
        buffers, places = pending.layout()
        nbytes = write_gathered(self._writers[path], buffers, 0)
        with self._lock:
            self.stats.stored.update(places)
            self.stats.file_sizes[path] = nbytes
            self.stats.bytes_written += nbytes

    def _decide(self, pending: ReusingFile, job: _Job) -> _Decided:
        """Hash the job's chunks (block checksums and digest in one pass) and decide which
        are written; the writing runs on the next thread, overlapping the next job's hash."""
        if job.staged.ready:
            job.staged.ready()
        at, buffers = -1, []
        for i, (placed, begin, end, last) in enumerate(job.parts):
            start, pieces = pending.add(placed, job.staged.part(i, begin, end), last)
            if pieces and at < 0:
                at = start
            buffers.extend(pieces)
        return _Decided(job, at, tuple(buffers), pending.complete)

    def _write_decided(self, decided: _Decided) -> None:
        """The changed chunks back to back (one write), then the header once the file is."""
        started = time.perf_counter()
        path, buffers = decided.job.file, decided.buffers
        writer = self._writers[path]
        if len(buffers) == 1:  # as a plain save writes one piece: past the cache where it can
            writer.write_at(buffers[0], decided.at)
        elif buffers:
            write_gathered(writer, buffers, decided.at)
        if decided.complete:
            self._finish_reusing(path)
        with self._lock:
            self.stats.bytes_written += sum(len(b) for b in buffers)
            self.stats.write_s += time.perf_counter() - started

    def _finish_reusing(self, path: str) -> None:
        """Once every chunk of the file is decided: its header, or no file at all."""
        pending = self._reusing.pop(path, None) if self._reusing is not None else None
        if pending is None:
            return
        writer = self._writers[path]
        with self._lock:
            for key, w in pending.written.items():
                self.stats.stored[key] = StoredChunk(w.start, w.end, None, (), w.xxh3)
                self.stats.digests[key] = list(w.xxh3)
                self.stats.content[key] = w.digest
            for key, (prior, digest) in pending.reused.items():
                self.stats.reused[key] = prior
                self.stats.digests[key] = list(prior.xxh3)
                self.stats.content[key] = digest
        if pending.empty and pending.plan.items:
            del self._writers[path]
            writer.abort()  # removes the file: nothing of it is needed
            with self._lock:
                self.stats.dropped.add(path)
            return
        header = pending.header()
        writer.write_at(memoryview(header), 0)
        with self._lock:
            self.stats.file_sizes[path] = pending.cursor
            self.stats.bytes_written += len(header)

    def _hash(self, placed: PlacedItem, data: memoryview, last: bool) -> None:
        # an empty chunk starts where the next one does: the key needs its end too
        key = (placed.file, placed.start, placed.end)
        hasher = self._hashers.setdefault(key, BlockHasher(self.block_bytes))
        hasher.update(data)
        if last:
            self.stats.digests[key] = self._hashers.pop(key).finish()

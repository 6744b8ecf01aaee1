"""Tiered storage: shards land on a fast tier and are copied to a durable tier in the background.

``TieredStorage(LocalStorage("/nvme/run"), FsspecStorage("s3://bucket/run"))`` writes every
shard file to the fast tier at local-disk speed (so staging buffers are freed sooner) and, as
each file is closed, copies it to the durable tier on a small thread pool. Every other
mutation (``write_atomic``, ``remove``, ``remove_tree``) first waits for the copies in flight
and raises their error, then applies to the durable tier and the fast one, in that order. So
the commit protocol holds on the durable tier: a rank's marker is published only after its
shards are durable, and the manifest, written last, only after every marker; a failed copy
fails the save and nothing is committed. Reads prefer the fast tier and fall back to the
durable one (after a restart on another node the fast tier is empty). The fast tier is
assumed private to this job: nothing else should write the same fast directory.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from snapstate.storage.base import FileWriter, Storage

COPY_PIECE_BYTES = 16 << 20


class Uploads:
    """Copies in flight, shared by a tiered storage and its children, keyed by durable path.

    A failed copy's error belongs to its directory: it is raised by the next ``drain`` of a
    directory that holds the file (that checkpoint's marker or manifest write), or dropped
    when that file's tree is removed, so it never fails an unrelated checkpoint.
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="snapstate-tier")
        self._lock = threading.Lock()
        self._pending: dict[str, Future[None]] = {}

    def submit(self, key: str, fast: Storage, durable: Storage, path: str) -> None:
        try:
            future = self._pool.submit(copy_file, fast, durable, path)
        except RuntimeError:
            # The interpreter is exiting (an async save finishing at exit): copy inline.
            future = Future()
            try:
                copy_file(fast, durable, path)
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - raised by drain(), like a pooled copy's
                future.set_exception(exc)
        with self._lock:
            self._pending[key] = future

    def pending(self, key: str) -> bool:
        with self._lock:
            return key in self._pending

    def drain(self, prefix: str = "", raise_errors: bool = True) -> None:
        """Wait for every copy in flight; raise the first error of a file under ``prefix``."""
        with self._lock:
            items = list(self._pending.items())
        errors = [(key, future, future.exception()) for key, future in items]  # waits
        mine = []
        with self._lock:
            for key, future, error in errors:
                under = key.startswith(prefix)
                if (error is None or under) and self._pending.get(key) is future:
                    del self._pending[key]
                if error is not None and under:
                    mine.append(error)
        if mine and raise_errors:
            raise mine[0]


def copy_file(
    source: Storage, target: Storage, path: str, piece_bytes: int = COPY_PIECE_BYTES
) -> None:
    """Stream ``path`` from ``source`` to ``target`` in order (fine for sequential writers)."""
    size = source.size(path)
    buffer = memoryview(bytearray(min(piece_bytes, size)))
    writer = target.open_writer(path, size)
    try:
        for offset in range(0, size, piece_bytes):
            view = buffer[: min(piece_bytes, size - offset)]
            source.read_into(path, offset, view)
            writer.write_at(view, offset)
        writer.close(sync=True)
    except BaseException:
        writer.abort()
        raise


class _TieredWriter:
    """Writes to the fast tier; on close the file is queued for the durable tier."""

    def __init__(self, tiers: TieredStorage, path: str, inner: FileWriter) -> None:
        self.tiers, self.path, self.inner = tiers, path, inner
        self.sequential = inner.sequential

    def write_at(self, data: memoryview, offset: int) -> None:
        self.inner.write_at(data, offset)

    def close(self, sync: bool = True) -> None:
        self.inner.close(sync)
        self.tiers._upload(self.path)

    def abort(self) -> None:
        self.inner.abort()


class TieredStorage:
    """A checkpoint directory kept on ``fast`` and copied to ``durable``; ``root`` is the durable one."""

    def __init__(
        self,
        fast: Storage,
        durable: Storage,
        *,
        upload_threads: int = 4,
        uploads: Uploads | None = None,
    ) -> None:
        self.fast, self.durable = fast, durable
        self.root = durable.root
        self.uploads = uploads or Uploads(upload_threads)

    def drain(self) -> None:
        """Wait until every closed file is on the durable tier; raise a failed copy's error."""
        self.uploads.drain(self._key(""))

    def _key(self, path: str) -> str:
        return f"{self.durable.root}/{path}"

    def _upload(self, path: str) -> None:
        self.uploads.submit(self._key(path), self.fast, self.durable, path)

    def open_writer(self, path: str, size: int) -> FileWriter:
        if self.uploads.pending(self._key(path)):
            self.drain()  # the copy in flight still reads the old file
        return _TieredWriter(self, path, self.fast.open_writer(path, size))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        try:
            self.fast.read_into(path, offset, out)
        except FileNotFoundError:
            self.durable.read_into(path, offset, out)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            return self.fast.read_bytes(path, offset, length)
        except FileNotFoundError:
            return self.durable.read_bytes(path, offset, length)

    def size(self, path: str) -> int:
        try:
            return self.fast.size(path)
        except FileNotFoundError:
            return self.durable.size(path)

    def exists(self, path: str) -> bool:
        return self.fast.exists(path) or self.durable.exists(path)

    def listdir(self, path: str = "") -> list[str]:
        return sorted(set(self.fast.listdir(path)) | set(self.durable.listdir(path)))

    def write_atomic(self, path: str, data: bytes) -> None:
        # Durable first: a failure there leaves nothing committed on either tier.
        self.drain()
        self.durable.write_atomic(path, data)
        self.fast.write_atomic(path, data)

    def remove(self, path: str) -> None:
        # A failed copy of a file being removed is moot: drop its error.
        self.uploads.drain(self._key(path), raise_errors=False)
        self.durable.remove(path)
        self.fast.remove(path)

    def remove_tree(self, path: str = "") -> None:
        self.uploads.drain(self._key(path).rstrip("/") + "/", raise_errors=False)
        self.durable.remove_tree(path)
        self.fast.remove_tree(path)

    def makedirs(self, path: str = "") -> None:
        self.fast.makedirs(path)
        self.durable.makedirs(path)

    def sync_dir(self, path: str = "") -> None:
        self.fast.sync_dir(path)
        self.durable.sync_dir(path)

    def child(self, path: str) -> TieredStorage:
        return TieredStorage(self.fast.child(path), self.durable.child(path), uploads=self.uploads)

    def __repr__(self) -> str:
        return f"TieredStorage(fast={self.fast!r}, durable={self.durable!r})"

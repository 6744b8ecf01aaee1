"""Object stores and other fsspec file systems (``s3://``, ``gs://``, ``memory://``, ...).

Pointing snapstate at S3 (or an S3-compatible server such as MinIO or moto):

- A URL goes wherever a path goes: ``ss.save(state, "s3://bucket/run/ckpt")``,
  ``ss.CheckpointManager("s3://bucket/run")``, ``snapstate ls s3://bucket/run``.
- Credentials, region and endpoint come from the usual places, read by botocore and fsspec
  themselves: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``,
  ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for a non-AWS server, or fsspec's own
  configuration: ``FSSPEC_S3_ENDPOINT_URL=http://...``, ``FSSPEC_S3='{"key": ..., "secret": ...}'``
  or a JSON file in ``~/.config/fsspec/``; these work for the CLI too.
- In code, pass a storage object wherever a path goes, with any fsspec storage options:
  ``ss.save(state, FsspecStorage("s3://bucket/ckpt", endpoint_url="http://127.0.0.1:9000"))``,
  ``ss.CheckpointManager(FsspecStorage("s3://bucket/run", client_kwargs={...}))``.

Writes are sequential (``FileWriter.sequential``): each shard file streams out in order through
the file system's buffered writer, which for S3 is a multipart upload in parts of
``part_bytes``; the object appears only when the upload completes on ``close``, and an aborted
writer aborts the upload. ``write_atomic`` is a single PUT, atomic by itself, which is why the
manifest (written last) is the commit on object stores. Listings are never cached: other
ranks and other processes write the same prefix.
"""

from __future__ import annotations

import errno
import uuid
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from snapstate.storage.base import Capabilities

READ_PIECE_BYTES = 64 << 20  # one ranged GET at most; bounds the temporary copy of a large read
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}


class FsspecFileWriter:
    """Streams one file in order; an out-of-order ``write_at`` is a programming error."""

    sequential = True

    def __init__(
        self, fs: fsspec.AbstractFileSystem, full_path: str, part_bytes: int | None
    ) -> None:
        self.fs = fs
        self.full_path = full_path
        kwargs = {"block_size": part_bytes} if part_bytes else {}
        self.file: Any = fs.open(full_path, "wb", **kwargs)
        self.position = 0

    def write_at(self, data: memoryview, offset: int) -> None:
        if offset != self.position:
            raise ValueError(
                f"{self.full_path}: sequential writer got a write at byte {offset}, but the file "
                f"ends at byte {self.position}; object stores only append, so pieces must come in order"
            )
        self.file.write(data)
        self.position += len(data)

    def close(self, sync: bool = True) -> None:
        self.file.close()  # completes the upload: the object appears whole, now

    def abort(self) -> None:
        discard = getattr(self.file, "discard", None)
        try:
            if discard is not None:
                discard()  # S3: abort the multipart upload, no object appears
            # Mark closed so that the file's finalizer does not upload what was buffered.
            self.file.closed = True
        except Exception:  # noqa: BLE001 - best effort; the removal below is what matters
            pass
        try:
            self.fs.rm_file(self.full_path)
        except (FileNotFoundError, OSError):
            pass


class FsspecStorage:
    """A checkpoint directory (a key prefix, on object stores) on any fsspec file system."""

    def __init__(
        self,
        url: str,
        *,
        fs: fsspec.AbstractFileSystem | None = None,
        part_bytes: int | None = None,
        **storage_options: Any,
    ) -> None:
        self.root = url.rstrip("/")
        self.part_bytes = part_bytes
        if fs is None:
            storage_options.setdefault("use_listings_cache", False)
            fs, path = url_to_fs(self.root, **storage_options)
        else:
            path = fs._strip_protocol(self.root)
        self.fs: fsspec.AbstractFileSystem = fs
        self.path: str = path.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.object_store = bool(_OBJECT_STORES.intersection(protocols))

    def _full(self, path: str) -> str:
        return f"{self.path}/{path}" if path else self.path

    def open_writer(self, path: str, size: int) -> FsspecFileWriter:
        if not self.object_store:
            self.fs.makedirs(self.fs._parent(self._full(path)), exist_ok=True)
        return FsspecFileWriter(self.fs, self._full(path), self.part_bytes)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        got = 0
        while got < len(out):
            want = min(READ_PIECE_BYTES, len(out) - got)
            data = self._cat(path, offset + got, want)
            out[got : got + len(data)] = data
            got += len(data)
            if len(data) < want:
                raise EOFError(
                    f"{self.root}/{path}: file ends at byte {offset + got}, expected {offset + len(out)}"
                )

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if length is None and offset == 0:
            return bytes(self.fs.cat_file(self._full(path)))
        if length is None:
            length = max(self.size(path) - offset, 0)
        return self._cat(path, offset, length)

    def _cat(self, path: str, offset: int, length: int) -> bytes:
        # An empty range would be sent as an invalid Range header, which S3 answers with the
        # whole object; a range past the end is an error there and an empty read locally.
        if length <= 0:
            return b""
        try:
            return bytes(self.fs.cat_file(self._full(path), start=offset, end=offset + length))
        except OSError as exc:
            if exc.errno == errno.EINVAL and "range" in str(exc).lower():
                return b""
            raise

    def size(self, path: str) -> int:
        return int(self.fs.size(self._full(path)))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._full(path)))

    def listdir(self, path: str = "") -> list[str]:
        full = self._full(path)
        try:
            entries = self.fs.ls(full, detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = [str(e).rstrip("/") for e in entries]
        if found == [full]:
            return []  # ``ls`` of a file lists the file itself: not a directory
        return sorted({e.rsplit("/", 1)[-1] for e in found if e != full})

    def write_atomic(self, path: str, data: bytes) -> None:
        full = self._full(path)
        if self.object_store:
            self.fs.pipe_file(full, bytes(data))  # one PUT: the object appears whole or not at all
            return
        # A file system (sftp, hdfs, ...) writes in place: write aside, then rename over.
        parent = self.fs._parent(full)
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{full.rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:8]}.tmp"
        self.fs.pipe_file(tmp, bytes(data))
        try:
            self.fs.mv(tmp, full)
        except BaseException:
            self._remove_full(tmp)
            raise

    def capabilities(self) -> Capabilities:
        """A conditional create where the file system is S3 (``create_new``); nothing else."""
        return Capabilities(creates_new=self if hasattr(self.fs, "call_s3") else None)

    def create_new(self, path: str, data: bytes) -> None:
        """One conditional PUT (``If-None-Match: *``) on S3: the store refuses it with 412,
        which s3fs raises as FileExistsError, when the object exists. S3 and most compatible
        servers honour it; one that ignores the header behaves as ``write_atomic``."""
        call_s3 = getattr(self.fs, "call_s3", None)
        if call_s3 is None:
            raise NotImplementedError(f"{self.root}: no conditional create on this file system")
        bucket, key, _ = self.fs.split_path(self._full(path))
        call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(data), IfNoneMatch="*")

    def _remove_full(self, full: str) -> None:
        try:
            self.fs.rm_file(full)
        except FileNotFoundError:
            pass

    def remove(self, path: str) -> None:
        self._remove_full(self._full(path))

    def remove_tree(self, path: str = "") -> None:
        # Delete the files found under the prefix, never ``rm(recursive=True)`` on it: on a
        # bucket root that also deletes the bucket.
        full = self._full(path)
        try:
            files = self.fs.find(full)
        except FileNotFoundError:
            files = []
        if files:
            self.fs.rm(files)
        if not self.object_store and self.fs.isdir(full):
            self.fs.rm(full, recursive=True)

    def makedirs(self, path: str = "") -> None:
        if not self.object_store:  # object stores have no directories; nothing to create
            self.fs.makedirs(self._full(path), exist_ok=True)

    def sync_dir(self, path: str = "") -> None:
        """Nothing to do: an object or file is durable once its upload or close returned."""

    def child(self, path: str) -> FsspecStorage:
        return FsspecStorage(f"{self.root}/{path}", fs=self.fs, part_bytes=self.part_bytes)

    def __repr__(self) -> str:
        return f"FsspecStorage({self.root!r})"

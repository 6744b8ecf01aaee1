"""Reading a checkpoint's manifest safely, and verifying every byte it points to."""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field

from snapstate.engine.headers import ShardHeaders
from snapstate.errors import CheckpointIOError, CheckpointNotFoundError, CorruptCheckpointError
from snapstate.format.integrity import verify_blocks
from snapstate.format.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    ChunkRecord,
    Manifest,
    parse_manifest,
)
from snapstate.storage.base import Storage, capabilities, read_capped

VERIFY_READ_BYTES = 64 << 20


def read_manifest(storage: Storage, check_files: bool = True) -> Manifest:
    """The validated manifest; with ``check_files``, every shard exists with the recorded size."""
    manifest = parse_manifest(read_manifest_bytes(storage), file=f"{storage.root}/{MANIFEST}")
    if check_files:
        for path, rec in manifest.files.items():
            check_shard_file(storage, manifest, path, rec.bytes)
    return manifest


def check_shard_file(storage: Storage, manifest: Manifest, path: str, size: int) -> None:
    """The shard exists inside the checkpoint (no symlink out of it) with the recorded size."""
    keys = None
    links = capabilities(storage).link_check
    if links is not None and links.leaves_root(path):
        keys = keys_in_file(manifest, path)
        raise CorruptCheckpointError("shard file links outside the checkpoint", file=path, key=keys)
    try:
        actual = storage.size(path)
    except FileNotFoundError:
        keys = keys_in_file(manifest, path)
        raise CorruptCheckpointError("shard file is missing", file=path, key=keys) from None
    except OSError as exc:
        raise CheckpointIOError(
            exc.errno, f"{exc.strerror or exc} (reading)", exc.filename
        ) from exc
    if actual != size:
        raise CorruptCheckpointError(
            f"shard file has {actual} bytes, the manifest says {size}",
            file=path,
            key=keys_in_file(manifest, path),
        )


def read_manifest_bytes(storage: Storage) -> bytes:
    """manifest.json's bytes, at most MAX_MANIFEST_BYTES, from a regular file only; every
    failure is a CheckpointError (a manifest removed between two calls included)."""
    where = f"{storage.root}/{MANIFEST}"
    try:
        raw = read_capped(storage, MANIFEST, MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        state = "no such directory" if not storage.exists("") else "no manifest.json: not committed"
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {storage.root} ({state})"
        ) from None
    except IsADirectoryError:
        raise CorruptCheckpointError("manifest is a directory, not a file", file=where) from None
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ELOOP, errno.ENXIO):
            raise CorruptCheckpointError(
                f"manifest is not a regular file ({exc.strerror})", file=where
            ) from None
        raise CheckpointIOError(
            exc.errno, f"{exc.strerror or exc} (reading {where})", exc.filename
        ) from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"manifest is over the {MAX_MANIFEST_BYTES}-byte cap", file=where
        )
    return raw


def keys_in_file(manifest: Manifest, path: str, most: int = 5) -> str | None:
    """The keys whose chunks live in ``path``, for error messages."""
    keys = [
        k for k, rec in manifest.all_tensors().items() if any(c.file == path for c in rec.chunks)
    ]
    more = f" (+{len(keys) - most} more)" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more if keys else None


@dataclass
class VerifyReport:
    path: str
    files: int = 0
    tensors: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(
    storage: Storage, progress: Callable[[int], object] | None = None
) -> VerifyReport:
    """Check the manifest, every shard header against it, and every checksum block.

    Raises CorruptCheckpointError on the first problem, naming the file and key.
    """
    manifest = read_manifest(storage)
    report = VerifyReport(storage.root, files=len(manifest.files))
    headers = ShardHeaders(storage, manifest)
    for path in manifest.files:  # every file's header, those holding no chunk included
        try:
            headers.parsed(path, None)
        except CorruptCheckpointError as exc:
            if exc.key is not None:
                raise
            raise CorruptCheckpointError(
                exc.reason, file=path, key=keys_in_file(manifest, path)
            ) from None
    for key, rec in manifest.all_tensors().items():
        report.tensors += 1
        headers.check(key, rec)
    for key, rec in manifest.all_tensors().items():
        for chunk in rec.chunks:
            report.chunks += 1
            report.bytes_checked += _check_chunk(storage, key, chunk)
            if progress is not None:
                progress(chunk.end - chunk.start)
    return report


def _check_chunk(storage: Storage, key: str, chunk: ChunkRecord) -> int:
    step = (VERIFY_READ_BYTES // chunk.block_bytes) * chunk.block_bytes or chunk.block_bytes
    for offset in range(chunk.start, max(chunk.end, chunk.start + 1), step):
        length = min(step, chunk.end - offset)
        data = storage.read_bytes(chunk.file, offset, length)
        if len(data) != length:
            raise CorruptCheckpointError("shard file is truncated", file=chunk.file, key=key)
        bad = verify_blocks(
            memoryview(data),
            (offset - chunk.start) // chunk.block_bytes,
            chunk.block_bytes,
            chunk.xxh3,
        )
        if bad is not None:
            raise CorruptCheckpointError(
                f"checksum mismatch in block {bad} of chunk {chunk.name!r}",
                file=chunk.file,
                key=key,
            )
    return chunk.end - chunk.start

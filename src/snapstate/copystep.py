"""Copy one step of a manager root out as a self-contained checkpoint: the files it references
in earlier steps are copied as real files beside its own, and its manifest is rewritten
without references (format version 2), then the copy is verified."""

from __future__ import annotations

import os
import posixpath
from dataclasses import replace

from snapstate.engine.verify import VerifyReport, read_manifest, verify_checkpoint
from snapstate.errors import CheckpointExistsError
from snapstate.format.manifest import (
    MANIFEST,
    ChunkRecord,
    DigestChunk,
    FileRecord,
    Manifest,
    is_reference,
)
from snapstate.manager import step_dir
from snapstate.storage.base import Storage, storage_for

COPY_BYTES = 64 << 20  # read and written at most this much at a time


def copy_step(
    root: str | os.PathLike[str], step: int, dest: str | os.PathLike[str]
) -> VerifyReport:
    """Copy ``step`` of ``root`` to ``dest`` (a new directory) and verify the copy."""
    source = storage_for(root).child(step_dir(step))
    manifest = read_manifest(source)  # validated; every file there with its size
    target = storage_for(dest)
    if target.exists(MANIFEST):
        raise CheckpointExistsError(f"{target.root} already holds a committed checkpoint")
    names = {path: own_name(path) for path in manifest.files}
    target.makedirs("shards")
    for path, rec in manifest.files.items():
        copy_file(source, path, target, names[path], rec.bytes)
    target.sync_dir("shards")
    target.write_atomic(MANIFEST, without_references(manifest, names).to_json())
    target.sync_dir()
    return verify_checkpoint(target)


def own_name(path: str) -> str:
    """A referenced file's name in the copy: ``shards/step-<n>-<file>``; own files keep theirs."""
    if not is_reference(path):
        return path
    step, rest = path.split("/", 2)[1:]
    return f"shards/{step}-{rest.replace('/', '-')}"


def copy_file(source: Storage, path: str, target: Storage, name: str, size: int) -> None:
    writer = target.open_writer(name, size)
    try:
        for offset in range(0, size, COPY_BYTES):
            data = source.read_bytes(path, offset, min(COPY_BYTES, size - offset))
            writer.write_at(memoryview(data), offset)
        writer.close(sync=True)
    except BaseException:
        writer.abort()
        raise


def without_references(manifest: Manifest, names: dict[str, str]) -> Manifest:
    """The manifest with every file renamed as copied, chunks without digests: version 2."""

    def rename(c: ChunkRecord) -> ChunkRecord:
        if isinstance(c, DigestChunk):
            c = ChunkRecord(
                c.offsets, c.sizes, c.file, c.name, c.start, c.end, c.block_bytes, c.xxh3
            )
        return replace(c, file=names[c.file])

    for rec in manifest.all_tensors().values():
        rec.chunks = [rename(c) for c in rec.chunks]
    files = {names[p]: FileRecord(r.bytes, r.rank) for p, r in manifest.files.items()}
    assert all(not is_reference(p) and posixpath.normpath(p) == p for p in files)
    return replace(manifest, files=files)

"""Reading a compressed chunk: its stored frames read whole, verified, decoded, then selected.

A frame decodes only as a whole, so a target that needs any part of a compressed chunk reads
all of its stored bytes; a resharding load still reads and decodes only the chunks that
overlap its targets. The block checksums cover the stored bytes and are checked before any
frame is decoded, so damage is a CorruptCheckpointError naming the file and key, never a
decoder's garbage.
"""

from __future__ import annotations

from snapstate.engine.chunkread import ReadTask, chunk_box, read_bytes, select, verify
from snapstate.engine.staging import bits_view, byte_view
from snapstate.format import codec
from snapstate.format.dtypes import dtype_from_name, empty_bytes, itemsize
from snapstate.format.manifest import CompressedChunk, Manifest
from snapstate.storage.base import Storage


def any_compressed(manifest: Manifest) -> bool:
    """Whether the checkpoint holds a compressed chunk (the same answer on every rank)."""
    return any(c.compressed for t in manifest.all_tensors().values() for c in t.chunks)


def read_compressed(storage: Storage, task: ReadTask) -> int:
    """Read, verify and decode ``task``'s chunk, copy its part into the target; returns the
    stored bytes read."""
    chunk = task.chunk
    assert isinstance(chunk, CompressedChunk)
    stored = empty_bytes(chunk.end - chunk.start)
    view = byte_view(stored)
    read_bytes(storage, chunk, chunk.start, view, task.key)
    verify(view, 0, chunk, task.key)
    dtype = dtype_from_name(task.record.dtype)
    raw = empty_bytes(sum(n for _, n in chunk.frames))
    out, at_stored, at_raw = byte_view(raw), 0, 0
    for size, n in chunk.frames:
        frame = view[at_stored : at_stored + size]
        codec.decode_into(frame, out[at_raw : at_raw + n], chunk.file, task.key)
        at_stored, at_raw = at_stored + size, at_raw + n
    box = chunk_box(task)
    first_row = task.part.offsets[0] - box.offsets[0] if box.sizes else 0
    part = select(raw, 0, first_row, box, task.part, dtype, itemsize(dtype))
    bits_view(task.target).copy_(bits_view(part))
    return len(view)

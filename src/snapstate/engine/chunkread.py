"""One stored chunk's part that a target needs: reading, verifying and selecting its bytes.

Both load transports use these (``engine/load.py`` reads for this rank,
``engine/sharedread.py`` reads once and sends), so there is one whole-chunk test and one
read-and-verify, and neither transport imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from snapstate.engine.headers import shard_gone
from snapstate.engine.persist import as_checkpoint_error
from snapstate.errors import CheckpointError, CorruptCheckpointError
from snapstate.format.dtypes import dtype_from_name
from snapstate.format.dtypes import itemsize as dtype_itemsize
from snapstate.format.integrity import verify_blocks
from snapstate.format.manifest import ChunkRecord, TensorRecord
from snapstate.planning.items import Box
from snapstate.storage.base import Storage


@dataclass(frozen=True)
class ReadTask:
    key: str
    record: TensorRecord
    chunk: ChunkRecord
    part: Box  # the overlap, in global coordinates
    target: torch.Tensor  # the slice of the target's local data that receives ``part``


def chunk_box(task: ReadTask) -> Box:
    """The stored chunk's box, in global coordinates."""
    return Box(tuple(task.chunk.offsets), tuple(task.chunk.sizes))


def task_itemsize(task: ReadTask) -> int:
    return dtype_itemsize(dtype_from_name(task.record.dtype))


def reads_whole_chunk(task: ReadTask) -> bool:
    """The target takes the whole chunk into contiguous host memory: read straight into it
    (never a compressed chunk: its stored bytes are not the target's)."""
    return (
        not task.chunk.compressed
        and task.part == chunk_box(task)
        and task.target.is_contiguous()
        and task.target.device.type == "cpu"
    )


def select(
    buffer: torch.Tensor,
    span_start: int,
    row_start: int,
    chunk: Box,
    part: Box,
    dtype: torch.dtype,
    itemsize: int,
) -> torch.Tensor:
    if not chunk.sizes:
        return buffer.view(dtype).view(())
    row_bytes = math.prod(chunk.sizes[1:]) * itemsize
    begin = row_start * row_bytes - span_start
    rows = (
        buffer[begin : begin + part.sizes[0] * row_bytes]
        .view(dtype)
        .view(part.sizes[0], *chunk.sizes[1:])
    )
    inner = tuple(
        slice(p - c, p - c + s)
        for p, c, s in zip(part.offsets[1:], chunk.offsets[1:], part.sizes[1:])
    )
    return rows[(slice(None), *inner)]


def read_bytes(
    storage: Storage, chunk: ChunkRecord, offset: int, out: memoryview, key: str
) -> None:
    try:
        storage.read_into(chunk.file, offset, out)
    except FileNotFoundError:
        raise shard_gone(chunk.file, key) from None
    except EOFError as exc:
        raise CorruptCheckpointError(
            f"shard file is truncated: {exc}", file=chunk.file, key=key
        ) from None


def verify(data: memoryview, first_block: int, chunk: ChunkRecord, key: str) -> None:
    bad = verify_blocks(data, first_block, chunk.block_bytes, chunk.xxh3)
    if bad is not None:
        raise CorruptCheckpointError(
            f"checksum mismatch in block {bad} of chunk {chunk.name!r}", file=chunk.file, key=key
        )


@contextmanager
def load_errors(root: str) -> Iterator[None]:
    """Any OSError a read lets through leaves as a CheckpointError: a file gone is a shard
    removed while loading (a concurrent overwrite), anything else a CheckpointIOError."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        if isinstance(exc, FileNotFoundError):
            raise shard_gone(exc.filename or root, None) from exc
        raise as_checkpoint_error(exc, root, "loading") from exc

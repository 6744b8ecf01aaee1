"""Shard files in the safetensors layout: u64 header size, JSON header, one buffer without holes.

snapstate plans every byte of a shard before writing it, so the header is built up front and
the data is then written at known offsets, possibly in parallel. ``parse_header`` treats the
file as untrusted input; ``check_chunk_entry`` holds its header to what the manifest says.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from snapstate.errors import CorruptCheckpointError
from snapstate.format.dtypes import SAFETENSORS, safetensors_entry

if TYPE_CHECKING:
    from snapstate.format.manifest import ChunkRecord

HEADER_ALIGN = 64  # data buffer starts 64-byte aligned; tensors are ordered by itemsize
MAX_HEADER_BYTES = 100 << 20  # the cap safetensors' own reader applies


@dataclass(frozen=True)
class ShardEntry:
    """One tensor (a chunk of a checkpointed tensor) in a shard file."""

    name: str
    st_dtype: str
    shape: tuple[int, ...] | list[int]
    nbytes: int


def build_header(entries: list[ShardEntry], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """Header bytes (size prefix included) and each entry's absolute start offset in the file."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    relative = []
    for e in entries:
        header[e.name] = {
            "dtype": e.st_dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        relative.append(offset)
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(text)) // HEADER_ALIGN) * HEADER_ALIGN - 8
    text = text + b" " * (padded - len(text))
    data_start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, [data_start + r for r in relative]


@dataclass(frozen=True)
class ParsedShard:
    data_start: int
    # name -> (dtype, shape, begin, end) absolute
    entries: dict[str, tuple[str, list[int], int, int]]
    metadata: dict[str, str]


def parse_header(prefix: bytes, file_size: int, file: str) -> ParsedShard:
    """Validate a shard header; ``prefix`` holds at least the first 8 bytes of the file."""
    if file_size < 8 or len(prefix) < 8:
        raise CorruptCheckpointError("shard is shorter than its 8-byte header size", file=file)
    (size,) = struct.unpack("<Q", prefix[:8])
    if size > MAX_HEADER_BYTES or 8 + size > file_size:
        raise CorruptCheckpointError(
            f"shard header size {size} exceeds the file ({file_size} bytes) or the cap", file=file
        )
    if len(prefix) < 8 + size:
        raise CorruptCheckpointError("shard header truncated", file=file)
    try:
        header = json.loads(prefix[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"shard header is not valid JSON: {exc}", file=file) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError("shard header is not a JSON object", file=file)
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError("shard __metadata__ must map strings to strings", file=file)
    data_start = 8 + size
    entries = {
        name: _parse_entry(name, info, data_start, file_size, file) for name, info in header.items()
    }
    _check_no_holes(entries, data_start, file_size, file)
    return ParsedShard(data_start, entries, metadata)


def _parse_entry(
    name: str, info: object, data_start: int, file_size: int, file: str
) -> tuple[str, list[int], int, int]:
    if not isinstance(info, dict):
        raise CorruptCheckpointError("shard entry is not an object", file=file, key=name)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise CorruptCheckpointError("shard entry dtype is not a string", file=file, key=name)
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise CorruptCheckpointError(f"shard entry shape {shape!r} is invalid", file=file, key=name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
        or data_start + offsets[1] > file_size
    ):
        raise CorruptCheckpointError(
            f"shard entry data_offsets {offsets!r} fall outside the file", file=file, key=name
        )
    return dtype, shape, data_start + offsets[0], data_start + offsets[1]


def _check_no_holes(
    entries: dict[str, tuple[str, list[int], int, int]], data_start: int, file_size: int, file: str
) -> None:
    position = data_start
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != position:
            raise CorruptCheckpointError(
                f"shard buffer has a hole or overlap at byte {position}", file=file, key=name
            )
        position = end
    if position != file_size:
        raise CorruptCheckpointError(
            f"shard buffer ends at byte {position}, the file at {file_size}", file=file
        )


def check_chunk_entry(parsed: ParsedShard, chunk: ChunkRecord, dtype: str, key: str) -> None:
    """The shard header says of ``chunk`` what the manifest says (``dtype`` is the tensor's
    name on disk): its dtype, shape and byte range, so stored bytes are never reinterpreted.
    A difference is a CorruptCheckpointError naming the file, the key and what differs."""
    entry = parsed.entries.get(chunk.name)
    if entry is None:
        raise CorruptCheckpointError(
            f"shard header disagrees with the manifest: it has no entry {chunk.name!r}",
            file=chunk.file,
            key=key,
        )
    st_dtype, st_shape = _stored_as(chunk, dtype)
    got_dtype, got_shape, begin, end = entry
    differences = []
    if got_dtype != st_dtype:
        said = dtype if SAFETENSORS.get(dtype) == st_dtype else f"{dtype} stored as {st_dtype}"
        differences.append(f"manifest says {said}, shard header says {got_dtype}")
    if list(got_shape) != st_shape:
        differences.append(f"manifest says shape {st_shape}, shard header says {got_shape}")
    if (begin, end) != (chunk.start, chunk.end):
        differences.append(
            f"manifest says bytes [{chunk.start}, {chunk.end}), shard header says [{begin}, {end})"
        )
    if differences:
        raise CorruptCheckpointError(
            f"shard header disagrees with the manifest on chunk {chunk.name!r}: "
            + "; ".join(differences),
            file=chunk.file,
            key=key,
        )


def _stored_as(chunk: ChunkRecord, dtype: str) -> tuple[str, list[int]]:
    """The (dtype, shape) the header gives ``chunk``: compressed frames are bytes."""
    if chunk.compressed:
        return "U8", [chunk.end - chunk.start]
    return safetensors_entry(dtype, tuple(chunk.sizes), chunk.end - chunk.start)

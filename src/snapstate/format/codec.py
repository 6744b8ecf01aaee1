"""Lossless per-chunk compression: zstd, after grouping the bytes of float elements into planes.

The bytes of a float differ in how predictable they are: the sign and exponent of trained
weights take few values, the low mantissa bytes are close to noise. Split into planes (byte 0 of
every element, then byte 1, ...), the predictable planes compress well and a plane that does not
shrink is stored as it is, so its noise costs no decoder time. Integer and bool data is zstd'd
whole. Pure functions on bytes; the frame read back is untrusted input.

A frame: ``b"SSZ1"``, u8 itemsize ``k`` (1: no grouping), u64 raw length, then ``k`` planes, each
u8 mode (0 stored, 1 zstd) and u64 stored length, followed by the planes' bytes in order. Plane
``j`` of a grouped frame holds byte ``j`` of every element (``raw length / k`` bytes).
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from snapstate.errors import CorruptCheckpointError

MAGIC = b"SSZ1"
CODECS = ("zstd",)
_HEAD = struct.Struct("<4sBQ")
_PLANE = struct.Struct("<BQ")
_STORED, _ZSTD = 0, 1
# a plane is kept compressed only if zstd saves at least this share of it
_MIN_SAVING = 0.02
_FLOAT_KINDS = frozenset("fc")  # numpy kinds; bfloat16 and float8 come as their torch names
_TORCH_FLOATS = frozenset(
    {"bfloat16", "float16", "float32", "float64", "complex64", "complex128", "complex32"}
)


def group_width(dtype: str, itemsize: int) -> int:
    """How many byte planes a chunk of ``dtype`` is split into (1: not grouped)."""
    return itemsize if dtype in _TORCH_FLOATS and itemsize > 1 else 1


def encode(data: memoryview | bytes, width: int = 1, level: int = 1) -> bytes:
    """One frame holding ``data``; ``width`` > 1 groups its bytes into that many planes.

    ``data`` is only read (never reordered in place), so it may be a live tensor's memory.
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    if width > 1 and raw.size % width:
        raise ValueError(f"{raw.size} bytes do not split into elements of {width} bytes")
    planes = [raw] if width <= 1 else list(raw.reshape(-1, width).T)
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    parts: list[bytes | memoryview] = [_HEAD.pack(MAGIC, max(width, 1), raw.size)]
    bodies: list[bytes | memoryview] = []
    for plane in planes:
        flat = np.ascontiguousarray(plane)
        packed = compressor.compress(flat.data) if flat.size else b""
        if flat.size and len(packed) <= flat.size * (1 - _MIN_SAVING):
            parts.append(_PLANE.pack(_ZSTD, len(packed)))
            bodies.append(packed)
        else:
            parts.append(_PLANE.pack(_STORED, flat.size))
            bodies.append(flat.data)
    return b"".join([*parts, *bodies])


def decoded_size(frame: memoryview | bytes, file: str = "", key: str | None = None) -> int:
    """The raw length a frame says it holds (checked against the manifest by the caller)."""
    return _parse(memoryview(frame), file, key)[1]


def decode_into(
    frame: memoryview | bytes, out: memoryview, file: str = "", key: str | None = None
) -> None:
    """Decode one frame into ``out`` (exactly its raw length); damage is a CorruptCheckpointError.

    Block checksums are verified on the stored bytes before this runs: an error here means a
    writer bug or a frame that was damaged before it was hashed.
    """
    view = memoryview(frame)
    width, raw_len, planes = _parse(view, file, key)
    target = np.frombuffer(out, dtype=np.uint8)
    if target.size != raw_len:
        raise CorruptCheckpointError(
            f"compressed frame holds {raw_len} bytes, expected {target.size}", file=file, key=key
        )
    grid = target.reshape(-1, width) if width > 1 else target.reshape(1, -1)
    decompressor = zstandard.ZstdDecompressor()
    plane_len = raw_len // width
    for j, (mode, body) in enumerate(planes):
        if mode == _STORED:
            plane = np.frombuffer(body, dtype=np.uint8)
        else:
            plane = np.frombuffer(_unzstd(decompressor, body, plane_len, file, key), np.uint8)
        if plane.size != plane_len:
            raise CorruptCheckpointError(
                f"compressed plane {j} holds {plane.size} bytes, expected {plane_len}",
                file=file,
                key=key,
            )
        if width > 1:
            grid[:, j] = plane
        else:
            grid[0, :] = plane


def decode(frame: memoryview | bytes, file: str = "", key: str | None = None) -> bytearray:
    """A frame's raw bytes, in a new buffer."""
    out = bytearray(decoded_size(frame, file, key))
    decode_into(frame, memoryview(out), file, key)
    return out


def _unzstd(
    decompressor: zstandard.ZstdDecompressor,
    body: memoryview,
    size: int,
    file: str,
    key: str | None,
) -> bytes:
    try:
        return decompressor.decompress(body, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(
            f"compressed plane does not decode: {exc}", file=file, key=key
        ) from None


def _parse(
    view: memoryview, file: str, key: str | None
) -> tuple[int, int, list[tuple[int, memoryview]]]:
    """(width, raw length, [(mode, body)]) of a frame, every length checked against the frame."""
    if len(view) < _HEAD.size or bytes(view[:4]) != MAGIC:
        raise CorruptCheckpointError("not a compressed frame (bad magic)", file=file, key=key)
    _, width, raw_len = _HEAD.unpack_from(view)
    if width < 1 or raw_len % width:
        raise CorruptCheckpointError(
            f"compressed frame of width {width} cannot hold {raw_len} bytes", file=file, key=key
        )
    at = _HEAD.size + width * _PLANE.size
    if len(view) < at:
        raise CorruptCheckpointError("compressed frame header truncated", file=file, key=key)
    planes = []
    for j in range(width):
        mode, length = _PLANE.unpack_from(view, _HEAD.size + j * _PLANE.size)
        if mode not in (_STORED, _ZSTD) or at + length > len(view):
            raise CorruptCheckpointError(
                f"compressed plane {j} (mode {mode}, {length} bytes) overruns the frame",
                file=file,
                key=key,
            )
        planes.append((mode, view[at : at + length]))
        at += length
    if at != len(view):
        raise CorruptCheckpointError(
            f"compressed frame has {len(view) - at} trailing bytes", file=file, key=key
        )
    return width, raw_len, planes

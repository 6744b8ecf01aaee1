"""Names of dtypes on disk: torch dtype <-> manifest name <-> safetensors header name."""

from __future__ import annotations

import math
import warnings

import torch

from snapstate.errors import CorruptCheckpointError

# Every non-quantized torch dtype that exists in the installed torch, by its torch name.
_CANDIDATES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "complex32",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "uint1",
    "uint2",
    "uint3",
    "uint4",
    "uint5",
    "uint6",
    "uint7",
    "int1",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
]

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _CANDIDATES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

# The safetensors names for the dtypes its readers know; other dtypes are stored as raw U8
# bytes in the shard header, their true dtype kept in the manifest.
SAFETENSORS: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be checkpointed") from None


def dtype_from_name(
    name: object, *, file: str | None = None, key: str | None = None
) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise CorruptCheckpointError(f"unknown dtype {name!r}", file=file, key=key)
    return DTYPES[name]


def itemsize(dtype: torch.dtype) -> int:
    return _ITEMSIZES[dtype] if dtype in _ITEMSIZES else torch.empty((), dtype=dtype).element_size()


_ITEMSIZES: dict[torch.dtype, int] = {}
with warnings.catch_warnings():  # complex32 warns that it is experimental
    warnings.simplefilter("ignore")
    for _dtype in DTYPES.values():
        _ITEMSIZES[_dtype] = torch.empty(0, dtype=_dtype).element_size()


BYTES_ALIGN = 64  # what torch's CPU allocator gives: every dtype's view of the bytes is aligned


def empty_bytes(nbytes: int, align: int = BYTES_ALIGN) -> torch.Tensor:
    """Uninitialized host bytes whose first byte is ``align``-aligned.

    Why not ``torch.empty``: under ``torch.use_deterministic_algorithms(True)`` (how a bitwise
    resume is trained) it fills new memory, a pass over bytes the caller overwrites at once;
    in a training process here, a 64 MiB staging slab took 27 ms instead of microseconds.
    """
    # A bare storage is not filled (nor is numpy's memory, but numpy asks for huge pages for
    # large arrays, and on this VM their first touch cost 2-4x, in the first save's stall).
    raw = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage(nbytes + align))
    skip = -raw.data_ptr() % align
    return raw[skip : skip + nbytes]


def empty_tensor(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialized storage for any dtype, allocated as bytes (see ``empty_bytes``; torch's
    fill under deterministic algorithms has no kernel for bit and sub-byte dtypes either)."""
    nbytes = math.prod(shape) * itemsize(dtype)
    return empty_bytes(nbytes).view(dtype).view(tuple(shape))


def safetensors_entry(name: str, shape: tuple[int, ...], nbytes: int) -> tuple[str, list[int]]:
    """The (dtype, shape) a shard header gives a chunk: its own, or raw bytes if unknown."""
    st = SAFETENSORS.get(name)
    return (st, list(shape)) if st else ("U8", [nbytes])

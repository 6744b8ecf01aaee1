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


def empty_tensor(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialized storage for any dtype, allocated as bytes.

    Going through uint8 keeps this working under ``torch.use_deterministic_algorithms``, which
    otherwise fills new memory and has no fill kernel for bit and sub-byte dtypes.
    """
    nbytes = math.prod(shape) * itemsize(dtype)
    return torch.empty(nbytes, dtype=torch.uint8).view(dtype).view(tuple(shape))


def safetensors_entry(name: str, shape: tuple[int, ...], nbytes: int) -> tuple[str, list[int]]:
    """The (dtype, shape) a shard header gives a chunk: its own, or raw bytes if unknown."""
    st = SAFETENSORS.get(name)
    return (st, list(shape)) if st else ("U8", [nbytes])

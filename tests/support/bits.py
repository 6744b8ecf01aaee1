"""Bitwise equality of tensors and of whole state trees (NaN payloads and -0.0 included)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def itemsize(dtype: torch.dtype) -> int:
    with warnings.catch_warnings():  # complex32 warns that it is experimental
        warnings.simplefilter("ignore")
        return torch.empty(0, dtype=dtype).element_size()


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of the same size: comparable bitwise (NaN payloads included)."""
    t = t.detach()
    int_dtype = _SAME_SIZE_INTS.get(t.element_size())
    if int_dtype is not None:
        return t.view(int_dtype)
    return t.reshape(-1).contiguous().view(torch.int64)  # 16-byte complex128


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in row-major order, as a flat uint8 tensor."""
    return bits(t).contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: Any, b: Any) -> bool:
    """Two tensors of the same dtype and shape whose every element has the same bit pattern."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(bits(a.detach().cpu()), bits(b.detach().cpu())))


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert same_bits(a, b)


def tree_differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place two state trees differ: tensors and arrays bitwise, floats NaN-aware, types
    and dict key order exact. Empty when the trees are equal."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        return [] if same_bits(a, b) else [f"{path}: tensors differ"]
    if isinstance(a, (np.ndarray, np.generic)):
        same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        return [] if same else [f"{path}: arrays differ"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in tree_differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b)) for d in tree_differences(x, y, f"{path}/{i}")
        ]
    if isinstance(a, float) and a != a:
        return [] if b != b else [f"{path}: nan != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Deep equality of state trees (see ``tree_differences``)."""
    differences = tree_differences(a, b, path)
    assert not differences, "\n".join(differences)

"""Shared helpers of the unit tests: bitwise comparison and random tensors of any dtype."""

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


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (any bit pattern: NaNs, subnormals, sub-byte values)."""
    size = itemsize(dtype)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (*shape[:-1], shape[-1] * size) if shape else (size,),
        dtype=torch.uint8,
        generator=gen,
    )
    out = raw.view(dtype)
    return out if shape else out.reshape(())


def zeros_like_layout(t: torch.Tensor) -> torch.Tensor:
    """A zero tensor with ``t``'s dtype, shape and strides (no fill kernel needed)."""
    out = torch.empty_like(t)
    bits(out).zero_() if out.element_size() in _SAME_SIZE_INTS else out.zero_()
    return out


def assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Deep equality of state trees: tensors and arrays bitwise, floats NaN-aware, types exact."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert_bitwise_equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"

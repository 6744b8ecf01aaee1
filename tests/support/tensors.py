"""Tensors for round-trip tests: random bit patterns of any dtype, zeros of the same layout."""

from __future__ import annotations

import torch

from .bits import bits, itemsize


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
    bits(out).zero_() if out.element_size() in (1, 2, 4, 8) else out.zero_()
    return out

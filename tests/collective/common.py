"""Helpers of the rank-side scenarios and the tests: deterministic values, digests, key paths."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch


def pattern(shape: tuple[int, ...], salt: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct, cheap, reproducible values (full tensor: every rank can regenerate any part)."""
    n = math.prod(shape)
    x = torch.arange(n, dtype=torch.int64).mul_(2654435761).add_(salt * 1000003).remainder_(1 << 20)
    return (x.to(torch.float64) / (1 << 20) - 0.5).to(dtype).reshape(shape)


def digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by key path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat_tensors(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat_tensors(v, f"{prefix}/{i}" if prefix else str(i)))
    return out

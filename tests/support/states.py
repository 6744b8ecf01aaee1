"""Training states to round-trip: a small trained model and optimizer, odd dtypes, plain values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import snapstate as ss

from .bits import same_bits


def trained(
    widths: Sequence[int], *, relu: bool = False, batch: int = 8, lr: float = 1e-3, seed: int = 0
) -> tuple[nn.Sequential, torch.optim.Adam]:
    """A stack of Linear layers (ReLU between them with ``relu``) and its Adam after one step."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        if relu and i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(n_in, n_out))
    model = nn.Sequential(*layers)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    model(torch.randn(batch, widths[0])).sum().backward()
    optim.step()
    return model, optim


def blank_like(tree: Any) -> Any:
    """A load target of ``tree``'s structure: tensors and arrays zeroed (same dtype and shape),
    plain values as they are."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree.detach())
    if isinstance(tree, np.ndarray):
        return np.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: blank_like(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(blank_like(v) for v in tree)
    return tree


def training_state(seed: int = 0, width: int = 32) -> dict[str, Any]:
    """A small model and optimizer after one step, odd dtypes, an array and plain values."""
    model, optim = trained((width, width, 4), relu=True, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        "model": model,
        "optim": optim,
        "extra": {
            "bf16": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
            "i64": torch.randint(-(2**40), 2**40, (11,), generator=gen),
            "mask": torch.rand(3, 3, generator=gen) > 0.5,
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "array": np.arange(12, dtype=np.int32).reshape(3, 4) * (seed + 1),
        },
        "epoch": 3 + seed,
        "name": f"run-{seed}",
        "rng": ss.RNGState(),
    }


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a training state, by a readable key (model and optimizer flattened)."""
    out = {f"model/{k}": v for k, v in state["model"].state_dict().items()}
    for pid, slots in state["optim"].state_dict()["state"].items():
        out.update({f"optim/{pid}/{k}": v for k, v in slots.items() if isinstance(v, torch.Tensor)})
    out.update({f"extra/{k}": v for k, v in state["extra"].items() if isinstance(v, torch.Tensor)})
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bitwise equality of every tensor, array and plain value of two training states."""
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        x, y = ta[key], tb[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert same_bits(x, y), key
    assert np.array_equal(a["extra"]["array"], b["extra"]["array"])
    assert a["extra"]["array"].dtype == b["extra"]["array"].dtype
    assert (a["epoch"], a["name"]) == (b["epoch"], b["name"])

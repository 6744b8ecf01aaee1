"""Consolidation: a (possibly sharded) checkpoint as one full state, or exported to one file."""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import numpy as np
import torch

from snapstate.engine.readstate import read_plain
from snapstate.engine.verify import read_manifest
from snapstate.state.flatten import join_key
from snapstate.storage.base import storage_for


def _full_state(path: str | os.PathLike[str]) -> Any:
    """Everything but per-rank state, as plain containers."""
    storage = storage_for(path)
    return read_plain(storage, read_manifest(storage), None, None)


def export_checkpoint(
    path: str | os.PathLike[str], to: Literal["torch", "safetensors"], out: str | os.PathLike[str]
) -> int:
    """Write the consolidated state to ``out``; returns the number of tensors written."""
    state = _full_state(path)
    if to == "torch":
        plain = _torch_friendly(state)
        torch.save(plain, out)
        return sum(1 for _ in _leaves(plain) if isinstance(_, torch.Tensor))
    if to == "safetensors":
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        values: dict[str, Any] = {}
        for key, leaf in _flat_items(_torch_friendly(state), ""):
            if isinstance(leaf, torch.Tensor):
                tensors[key] = leaf.contiguous()
            else:
                values[key] = leaf
        save_file(
            tensors,
            os.fspath(out),
            metadata={"format": "snapstate-export", "values": json.dumps(values)},
        )
        return len(tensors)
    raise ValueError(f"unknown export format {to!r}; use 'torch' or 'safetensors'")


def _torch_friendly(value: Any) -> Any:
    """numpy arrays become tensors, so ``torch.load(weights_only=True)`` accepts the file."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return torch.from_numpy(np.asarray(value))
    if isinstance(value, dict):
        return {k: _torch_friendly(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_torch_friendly(v) for v in value)
    return value


def _flat_items(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flat_items(v, join_key(prefix, k))]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in _flat_items(v, join_key(prefix, i))]
    return [(prefix, value)]


def _leaves(value: Any) -> list[Any]:
    return [leaf for _, leaf in _flat_items(value, "")]

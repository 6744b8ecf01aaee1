"""Wrappers that count or fail storage operations, and a training state to round-trip."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

import snapstate as ss
from snapstate.storage.base import FileWriter, Storage


class Delegating:
    """A Storage that forwards everything to ``inner``; subclasses override what they watch."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.root = inner.root

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class CountingStorage(Delegating):
    """Counts the bytes read, per file, by ``read_into`` (tensor data) and ``read_bytes``."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.lock = threading.Lock()
        self.data_reads: dict[str, int] = {}
        self.small_reads: dict[str, int] = {}

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(path, offset, out)
        with self.lock:
            self.data_reads[path] = self.data_reads.get(path, 0) + len(out)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.read_bytes(path, offset, length)
        with self.lock:
            self.small_reads[path] = self.small_reads.get(path, 0) + len(data)
        return data

    def child(self, path: str) -> CountingStorage:
        return CountingStorage(self.inner.child(path))


class _FailingWriter:
    def __init__(self, inner: FileWriter, fail_after: int) -> None:
        self.inner, self.fail_after, self.written = inner, fail_after, 0
        self.sequential = inner.sequential

    def write_at(self, data: memoryview, offset: int) -> None:
        if self.written + len(data) > self.fail_after:
            raise OSError("injected: device lost mid-write")
        self.inner.write_at(data, offset)
        self.written += len(data)

    def close(self, sync: bool = True) -> None:
        self.inner.close(sync)

    def abort(self) -> None:
        self.inner.abort()


class FaultyStorage(Delegating):
    """Shard writes fail once ``fail_after`` bytes of a file are written (a torn save)."""

    def __init__(self, inner: Storage, fail_after: int) -> None:
        super().__init__(inner)
        self.fail_after = fail_after

    def open_writer(self, path: str, size: int) -> FileWriter:
        return _FailingWriter(self.inner.open_writer(path, size), self.fail_after)


def training_state(seed: int = 0, width: int = 32) -> dict[str, Any]:
    """A small model and optimizer after one step, odd dtypes, an array and plain values."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    optim.step()
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
    """Bitwise equality of every tensor, array and plain value."""
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        x, y = ta[key], tb[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8)), key
    assert np.array_equal(a["extra"]["array"], b["extra"]["array"])
    assert a["extra"]["array"].dtype == b["extra"]["array"].dtype
    assert (a["epoch"], a["name"]) == (b["epoch"], b["name"])

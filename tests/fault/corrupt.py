"""Tools to damage a checkpoint on purpose: edit its manifest, rewrite shard headers, flip bytes."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

import snapstate as ss
from snapstate.format.manifest import seal
from snapstate.storage.local import LocalStorage
from support.states import blank_like

SHARD = "shards/r00000-000.safetensors"


def small_state() -> dict[str, Any]:
    """A few tensors of several dtypes, a numpy array and JSON values; multi-block chunks."""
    gen = torch.Generator().manual_seed(7)
    return {
        "model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)},
        "opt": {"step": torch.tensor(5), "ids": torch.arange(100, dtype=torch.int16)},
        "arr": np.linspace(0.0, 1.0, 50),
        "meta": {"epoch": 3, "name": "run"},
    }


def blank_small_state() -> dict[str, Any]:
    return blank_like(small_state())


SMALL_OPTIONS = ss.SaveOptions(block_bytes=1024)


def read_manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "manifest.json").read_bytes())


def write_manifest(ckpt: Path, doc: Any) -> None:
    """Write an edited manifest, re-sealed with a matching checksum so that the validator
    behind the checksum is what the test exercises."""
    (ckpt / "manifest.json").write_bytes(sealed(doc))


def sealed(doc: Any) -> bytes:
    """``doc`` as manifest bytes with a valid checksum (when it is a non-empty object)."""
    if isinstance(doc, dict):
        doc = {k: v for k, v in doc.items() if k != "checksum"}
    raw = json.dumps(doc).encode()
    try:
        return seal(raw)
    except ValueError:
        return raw


def edit_manifest(ckpt: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = read_manifest(ckpt)
    edit(doc)
    write_manifest(ckpt, doc)


def chunk(doc: dict[str, Any], key: str, index: int = 0) -> dict[str, Any]:
    return doc["tensors"][key]["chunks"][index]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), size


def rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change the shard's JSON header in place, padded to its old length so the data stays put."""
    header, size = read_header(path)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size, "edited header does not fit in the old one"
    write_header_bytes(path, text + b" " * (size - len(text)))


def write_header_bytes(path: Path, text: bytes) -> None:
    """Overwrite the header text (same length as before) without touching the data."""
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(text)


def set_header_size(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", size))


class Allocations:
    """The largest buffers snapstate asked for while watched: tensors and file reads."""

    def __init__(self) -> None:
        self.largest_tensor = 0
        self.largest_read = 0
        self.rss_growth = 0


@contextmanager
def watch_allocations(monkeypatch: Any) -> Iterator[Allocations]:
    """Record every torch.empty and every read snapstate makes, and how much RSS grew."""
    seen = Allocations()
    real_empty = torch.empty
    real_read_bytes, real_read_into = LocalStorage.read_bytes, LocalStorage.read_into

    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        dims = (
            size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        )
        numel = math.prod(int(d) for d in dims)
        itemsize = real_empty(0, dtype=kwargs.get("dtype")).element_size()
        seen.largest_tensor = max(seen.largest_tensor, numel * itemsize)
        return real_empty(*size, **kwargs)

    def read_bytes(
        self: LocalStorage, path: str, offset: int = 0, length: int | None = None
    ) -> bytes:
        seen.largest_read = max(
            seen.largest_read, length if length is not None else self.size(path) - offset
        )
        return real_read_bytes(self, path, offset, length)

    def read_into(self: LocalStorage, path: str, offset: int, out: memoryview) -> None:
        seen.largest_read = max(seen.largest_read, len(out))
        real_read_into(self, path, offset, out)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(LocalStorage, "read_bytes", read_bytes)
    monkeypatch.setattr(LocalStorage, "read_into", read_into)
    rss = psutil.Process().memory_info().rss
    try:
        yield seen
    finally:
        seen.rss_growth = psutil.Process().memory_info().rss - rss
        monkeypatch.setattr(torch, "empty", real_empty)
        monkeypatch.setattr(LocalStorage, "read_bytes", real_read_bytes)
        monkeypatch.setattr(LocalStorage, "read_into", real_read_into)

"""Issue 31 items 7 and 8: every read path holds the manifest to the shard headers (real files).

A manifest resealed with another dtype, shape or byte range verifies on its own, and the block
checksums still pass: only the shard header tells. Each load path (mapped, own reads, span
reads, partial loads, ``read_state``, export) refuses it with a CorruptCheckpointError naming
the file, the key and what differs, and leaves the target as it was; a sparse shard that
claims a huge tensor is refused before anything is allocated for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
import snapstate.format.dtypes as dtypes
from snapstate.export import export_checkpoint
from snapstate.format.integrity import block_count
from snapstate.storage.local import LocalStorage
from support.storages import CountingStorage

from .corrupt import SHARD, SMALL_OPTIONS, chunk, edit_manifest


def state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(31)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "v": torch.randn(64, 32, generator=gen),  # as many bytes as w: ranges can be swapped
        "n": torch.arange(100, dtype=torch.int32),
    }


def saved(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ss.save(state(), ckpt, options=SMALL_OPTIONS)  # 1 KiB blocks: several per chunk
    return ckpt


def retype_w(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["dtype"] = "int32"  # same itemsize: every size check still passes


def reshape_w(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["shape"] = [32, 64]
    chunk(doc, "w")["sizes"] = [32, 64]


def swap_w_and_v(doc: dict[str, Any]) -> None:
    """w's chunk points at v's bytes and v's at w's, checksums swapped too: all verify."""
    w, v = chunk(doc, "w"), chunk(doc, "v")
    for field in ("start", "end", "xxh3"):
        w[field], v[field] = v[field], w[field]


# (the manifest edit, the target that matches the edited manifest, what the error says)
EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], Callable[[], torch.Tensor], str]] = {
    "dtype": (
        retype_w,
        lambda: torch.full((64, 32), 7, dtype=torch.int32),
        "manifest says int32, shard header says F32",
    ),
    "shape": (
        reshape_w,
        lambda: torch.full((32, 64), 7.0),
        "manifest says shape [32, 64], shard header says [64, 32]",
    ),
    "offsets": (swap_w_and_v, lambda: torch.full((64, 32), 7.0), "manifest says bytes ["),
}


def _own_reads(target: dict[str, Any], ckpt: Path) -> None:
    # a backend without map_file: every byte read into place (or copied aside first)
    ss.load(target, CountingStorage(LocalStorage(str(ckpt))))


def _span_read(target: dict[str, Any], ckpt: Path) -> None:
    # a non-contiguous target: the covering span is read into a buffer, then copied
    w = target["w"]
    target["w"] = torch.empty(w.shape[::-1], dtype=w.dtype).t()
    target["w"].copy_(w)
    ss.load(target, ckpt)


LOADS: dict[str, Callable[[dict[str, Any], Path], Any]] = {
    "mapped": lambda target, ckpt: ss.load(target, ckpt),
    "own-reads": _own_reads,
    "span-read": _span_read,
    "not-strict": lambda target, ckpt: ss.load(target, ckpt, strict=False),
}


@pytest.mark.parametrize("load", sorted(LOADS))
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_load_refuses_a_manifest_the_header_contradicts(
    tmp_path: Path, edit: str, load: str
) -> None:
    ckpt = saved(tmp_path)
    change, make_target, says = EDITS[edit]
    edit_manifest(ckpt, change)
    target = {"w": make_target(), "n": torch.zeros(100, dtype=torch.int32)}
    before = {k: t.clone() for k, t in target.items()}
    with pytest.raises(ss.CorruptCheckpointError) as info:
        LOADS[load](target, ckpt)
    message = str(info.value)
    assert says in message and "key 'w'" in message and SHARD in message, message
    assert info.value.file == SHARD and info.value.key == "w"
    for key, old in before.items():
        assert torch.equal(target[key], old), f"{key} changed by a refused load"


def test_partial_load_of_the_changed_key_alone_is_refused(tmp_path: Path) -> None:
    ckpt = saved(tmp_path)
    edit_manifest(ckpt, retype_w)
    target = {"w": torch.full((64, 32), 7, dtype=torch.int32)}  # only w, of three keys
    with pytest.raises(ss.CorruptCheckpointError, match="manifest says int32"):
        ss.load(target, ckpt)
    assert torch.equal(target["w"], torch.full((64, 32), 7, dtype=torch.int32))
    other = {"n": torch.zeros(100, dtype=torch.int32)}  # the same shard's intact tensor loads
    ss.load(other, ckpt)
    assert torch.equal(other["n"], state()["n"])


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("keys", [None, ["w"]], ids=["all", "partial"])
def test_read_state_refuses_a_manifest_the_header_contradicts(
    tmp_path: Path, edit: str, keys: list[str] | None
) -> None:
    ckpt = saved(tmp_path)
    change, _, says = EDITS[edit]
    edit_manifest(ckpt, change)
    with pytest.raises(ss.CorruptCheckpointError, match="key 'w'") as info:
        ss.read_state(ckpt, keys)
    assert says in str(info.value) and info.value.file == SHARD


def test_export_refuses_a_manifest_the_header_contradicts(tmp_path: Path) -> None:
    ckpt = saved(tmp_path)
    edit_manifest(ckpt, retype_w)
    out = tmp_path / "out.safetensors"
    with pytest.raises(ss.CorruptCheckpointError, match="manifest says int32"):
        export_checkpoint(ckpt, "safetensors", out)
    assert not out.exists()


def test_verify_names_the_key_and_the_difference(tmp_path: Path) -> None:
    ckpt = saved(tmp_path)
    edit_manifest(ckpt, retype_w)
    with pytest.raises(ss.CorruptCheckpointError, match="manifest says int32") as info:
        ss.verify(ckpt)
    assert info.value.key == "w" and info.value.file == SHARD


class _HeaderReads(CountingStorage):
    """Counts the small reads (``read_bytes``: headers) per file."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: dict[str, int] = {}

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        self.calls[path] = self.calls.get(path, 0) + 1
        assert length is not None, "a header read is always bounded"
        return super().read_bytes(path, offset, length)


def test_each_header_is_read_once_per_load_and_no_more_than_it_is(tmp_path: Path) -> None:
    ckpt = saved(tmp_path)
    header_bytes = 8 + int.from_bytes((ckpt / SHARD).read_bytes()[:8], "little")
    storage = _HeaderReads(LocalStorage(str(ckpt)))
    target = {k: torch.zeros_like(t) for k, t in state().items()}
    ss.load(target, storage)  # three tensors in one shard
    assert storage.calls[SHARD] == 1  # one header read for three tensors
    assert storage.small_reads[SHARD] == header_bytes  # the header, not a data byte
    assert all(torch.equal(target[k], t) for k, t in state().items())


GIB8 = 8 << 30


def huge_claim(tmp_path: Path) -> Path:
    """A checkpoint of one small tensor whose manifest (resealed) says it is 8 GiB of float32
    filling its shard, truncated (sparse, no disk used) to 8 GiB."""
    ckpt = tmp_path / "huge"
    ss.save({"w": torch.randn(64, 32)}, ckpt)

    def edit(doc: dict[str, Any]) -> None:
        c = chunk(doc, "w")
        doc["tensors"]["w"]["shape"] = c["sizes"] = [GIB8 // 4]
        c["offsets"] = [0]
        c["start"], c["end"] = 0, GIB8
        c["xxh3"] = ["0" * 16] * block_count(GIB8, c["block_bytes"])
        doc["files"][SHARD]["bytes"] = GIB8

    edit_manifest(ckpt, edit)
    with open(ckpt / SHARD, "r+b") as f:
        f.truncate(GIB8)
    return ckpt


def _refuse_large_allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch-free host allocations over 64 MiB fail as on the machine that found the bug."""
    asked: list[int] = []
    real = dtypes.empty_bytes

    def empty_bytes(nbytes: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        asked.append(nbytes)
        if nbytes > 64 << 20:
            raise RuntimeError(f"can't allocate memory: {nbytes} bytes (refused by the test)")
        return real(nbytes, *args, **kwargs)

    monkeypatch.setattr(dtypes, "empty_bytes", empty_bytes)
    return asked


def test_materialize_of_a_sparse_8_gib_shard_fails_before_allocating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = huge_claim(tmp_path)
    assert ss.inspect(ckpt).tensors["w"].nbytes == GIB8  # the manifest itself validates
    asked = _refuse_large_allocations(monkeypatch)
    with pytest.raises(ss.CorruptCheckpointError) as info:
        ss.read_state(ckpt)
    assert info.value.file == SHARD and info.value.key == "w", str(info.value)
    assert all(n <= 64 << 20 for n in asked), f"allocated {max(asked)} bytes first"
    with pytest.raises(ss.CorruptCheckpointError):
        ss.read_state(ckpt, ["w"])
    assert math.prod(ss.inspect(ckpt).tensors["w"].shape) * 4 == GIB8

"""SaveOptions(compression="zstd"): lossless round trips, the manifest's codec, damage found
before decoding, and uncompressed checkpoints unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.errors import CorruptCheckpointError, UnsupportedFormatError
from snapstate.format import manifest as manifest_format
from snapstate.format.dtypes import DTYPES
from snapstate.format.manifest import parse_manifest, seal
from support.bits import itemsize, same_bits
from support.tensors import random_tensor, zeros_like_layout

ZSTD = ss.SaveOptions(compression="zstd")
BYTE_DTYPES = [d for d in DTYPES.values() if itemsize(d) >= 1]


def _weights(dtype: torch.dtype, n: int = 1 << 14) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    return (torch.randn(n, generator=gen) * 0.02).to(dtype)


def _load_back(state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    target = {k: zeros_like_layout(v) for k, v in state.items()}
    ss.load(target, path)
    return target


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
def test_every_dtype_round_trips_compressed(dtype: torch.dtype, tmp_path: Path) -> None:
    state = {
        "big": random_tensor(dtype, (64, 80), seed=1),  # over the 4 KiB floor: compressed
        "small": random_tensor(dtype, (3,), seed=2),  # stored as it is
        "scalar": random_tensor(dtype, (), seed=3),
    }
    ss.save(state, str(tmp_path / "c"), options=ZSTD)
    chunks = {k: t.chunks for k, t in ss.inspect(str(tmp_path / "c")).tensors.items()}
    assert chunks["big"][0].compressed and not chunks["small"][0].compressed
    back = _load_back(state, str(tmp_path / "c"))
    assert all(same_bits(back[k], state[k]) for k in state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_compressed_async_save_in_many_frames(dtype: torch.dtype, tmp_path: Path) -> None:
    state = {"w": _weights(dtype, 1 << 16).reshape(256, -1)}
    options = ss.SaveOptions(compression="zstd", piece_bytes=1 << 14)
    ss.async_save(state, str(tmp_path / "a"), options=options).wait()
    chunk = ss.inspect(str(tmp_path / "a")).tensors["w"].chunks[0]
    assert chunk.compressed and len(chunk.frames) > 1  # type: ignore[attr-defined]
    assert ss.verify(str(tmp_path / "a")).ok
    assert same_bits(_load_back(state, str(tmp_path / "a"))["w"], state["w"])


def test_manifest_records_codec_and_version(tmp_path: Path) -> None:
    state = {"w": _weights(torch.bfloat16)}
    ss.save(state, str(tmp_path / "c"), options=ZSTD)
    doc = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    chunk = doc["tensors"]["w"]["chunks"][0]
    assert doc["version"] == manifest_format.COMPRESSED_VERSION
    assert chunk["codec"] == "zstd" and sum(f[1] for f in chunk["frames"]) == 2 << 14
    assert chunk["end"] - chunk["start"] == sum(f[0] for f in chunk["frames"]) < 2 << 14
    # the shard stays a safetensors file: the frames are a U8 entry
    header = (tmp_path / "c" / chunk["file"]).read_bytes()
    size = int.from_bytes(header[:8], "little")
    entry = json.loads(header[8 : 8 + size])[chunk["name"]]
    assert entry["dtype"] == "U8" and entry["shape"] == [chunk["end"] - chunk["start"]]


def test_uncompressed_saves_are_unchanged(tmp_path: Path) -> None:
    state = {"w": _weights(torch.float32)}
    ss.save(state, str(tmp_path / "p"))
    raw = (tmp_path / "p" / "manifest.json").read_bytes()
    assert json.loads(raw)["version"] == 2 and b"codec" not in raw
    assert same_bits(_load_back(state, str(tmp_path / "p"))["w"], state["w"])


def test_a_reader_before_compression_refuses_as_newer_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ss.save({"w": _weights(torch.float32)}, str(tmp_path / "c"), options=ZSTD)
    raw = (tmp_path / "c" / "manifest.json").read_bytes()
    monkeypatch.setattr(manifest_format, "READ_VERSIONS", (1, 2))
    with pytest.raises(UnsupportedFormatError):
        parse_manifest(raw)


def _resealed(raw: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    doc = json.loads(raw)
    doc.pop("checksum")
    edit(doc)
    return seal(json.dumps(doc, separators=(",", ":")).encode())


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=2), "version 2 chunk has a codec"),
        (lambda d: d["tensors"]["w"]["chunks"][0].update(codec="lz4"), "unknown codec"),
        (lambda d: d["tensors"]["w"]["chunks"][0]["frames"][0].__setitem__(1, 7), "add up"),
        (lambda d: d["tensors"]["w"]["chunks"][0].update(frames=3), "frames is not a list"),
    ],
)
def test_bad_codec_fields_are_corrupt(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    ss.save({"w": _weights(torch.float32)}, str(tmp_path / "c"), options=ZSTD)
    raw = _resealed((tmp_path / "c" / "manifest.json").read_bytes(), edit)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        parse_manifest(raw)
    assert info.value.key == "w"


def test_a_damaged_compressed_byte_is_found_before_decoding(tmp_path: Path) -> None:
    state = {"w": _weights(torch.float32)}
    path = tmp_path / "c"
    ss.save(state, str(path), options=ZSTD)
    chunk = ss.inspect(str(path)).tensors["w"].chunks[0]
    shard = path / chunk.file
    data = bytearray(shard.read_bytes())
    data[(chunk.start + chunk.end) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    target = {"w": torch.zeros_like(state["w"])}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        ss.load(target, str(path))
    assert info.value.file == chunk.file and info.value.key == "w"
    assert torch.count_nonzero(target["w"]) == 0  # the failed load left the target as it was
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ss.verify(str(path))


def test_unknown_compression_is_refused() -> None:
    with pytest.raises(ValueError, match="compression='lz4'"):
        ss.SaveOptions(compression="lz4")

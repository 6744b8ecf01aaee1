"""Issue 31 item 5: bit flips in the version byte do not switch the manifest checksum off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import snapstate as ss


def _flip_bits(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def _saved(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ss.save({"w": torch.arange(8.0), "epoch": 37}, ckpt)
    return ckpt


def test_version_2_flipped_to_1_is_still_checked(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    manifest = ckpt / "manifest.json"
    raw = manifest.read_bytes()
    at = raw.index(b'"version":2') + len(b'"version":')
    _flip_bits(manifest, at, ord("2") ^ ord("1"))  # two bit errors: 2 -> 1
    assert b'"version":1' in manifest.read_bytes()
    with pytest.raises(ss.CorruptCheckpointError, match="checksum"):
        ss.load({"w": torch.zeros(8), "epoch": 0}, ckpt)


def test_version_flip_and_a_value_flip_never_load_silently(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    manifest = ckpt / "manifest.json"
    raw = manifest.read_bytes()
    _flip_bits(manifest, raw.index(b'"version":2') + len(b'"version":'), 0x03)
    _flip_bits(manifest, raw.index(b"37") + 1, 0x01)  # epoch 37 -> 36
    target = {"w": torch.zeros(8), "epoch": 0}
    with pytest.raises(ss.CorruptCheckpointError):
        ss.load(target, ckpt)
    assert target["epoch"] == 0
    with pytest.raises(ss.CorruptCheckpointError):
        ss.verify(ckpt)

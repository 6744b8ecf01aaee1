"""Bit flips in a real manifest.json: every flip loads the identical state or raises a
CheckpointError (issue 12 item 4) - never a silently wrong load, never another exception."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import snapstate as ss
from support.bits import tree_differences
from support.states import blank_like


def run_state() -> dict[str, Any]:
    """Small on bytes, rich in manifest values a flip could silently change (epoch, lr, keys)."""
    gen = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(8, 4, generator=gen), "b": torch.randn(4, generator=gen)},
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, generator=gen)}},
            "param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], "params": [0, 1]}],
        },
        "arr": np.arange(6, dtype=np.int32),
        "meta": {"epoch": 7, "name": "run", "ok": True},
    }


def load_outcome(ckpt: Path, reference: dict[str, Any]) -> str:
    """'same', 'error', or what went wrong (a wrong load or an exception of another type)."""
    target = blank_like(reference)
    try:
        ss.load(target, ckpt)
    except ss.CheckpointError:
        return "error"
    except Exception as exc:  # noqa: BLE001 - the test reports every other type
        return f"{type(exc).__name__}: {exc}"[:200]
    differences = tree_differences(target, reference)
    return "same" if not differences else f"wrong load: {differences[:3]}"


def flip_sweep(ckpt: Path, reference: dict[str, Any], stride: int) -> dict[int, str]:
    path = ckpt / "manifest.json"
    pristine = path.read_bytes()
    bad: dict[int, str] = {}
    try:
        for bit in range(0, len(pristine) * 8, stride):
            damaged = bytearray(pristine)
            damaged[bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(bytes(damaged))
            outcome = load_outcome(ckpt, reference)
            if outcome not in ("same", "error"):
                bad[bit] = outcome
    finally:
        path.write_bytes(pristine)
    return bad


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = run_state()
    ss.save(state, tmp_path / "ckpt", step=12)
    assert load_outcome(tmp_path / "ckpt", state) == "same"
    return tmp_path / "ckpt", state


@pytest.mark.timeout(600)
def test_every_fifth_bit_flip_loads_identically_or_raises(
    checkpoint: tuple[Path, dict[str, Any]],
) -> None:
    ckpt, state = checkpoint
    bad = flip_sweep(ckpt, state, stride=5)
    assert not bad, f"{len(bad)} flips escaped: {list(bad.items())[:5]}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_single_bit_flip_loads_identically_or_raises(
    checkpoint: tuple[Path, dict[str, Any]],
) -> None:
    ckpt, state = checkpoint
    bad = flip_sweep(ckpt, state, stride=1)
    assert not bad, f"{len(bad)} flips escaped: {list(bad.items())[:5]}"


def test_value_edit_that_still_parses_is_refused(checkpoint: tuple[Path, dict[str, Any]]) -> None:
    """The examples of the issue: epoch 7 -> 5 (the JSON stays valid) is caught by the checksum."""
    ckpt, state = checkpoint
    path = ckpt / "manifest.json"
    raw = path.read_bytes()
    assert raw.count(b'["epoch",{"v":7}]') == 1
    path.write_bytes(raw.replace(b'["epoch",{"v":7}]', b'["epoch",{"v":5}]'))
    with pytest.raises(ss.CorruptCheckpointError, match="checksum"):
        ss.load(blank_like(state), ckpt)
    with pytest.raises(ss.CorruptCheckpointError, match="checksum"):
        ss.verify(ckpt)


def test_manifest_carries_checksum_and_version_2(checkpoint: tuple[Path, dict[str, Any]]) -> None:
    ckpt, _ = checkpoint
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    assert doc["version"] == 2
    assert list(doc)[-1] == "checksum" and len(doc["checksum"]) == 16


def test_version_1_manifest_without_checksum_still_loads(
    checkpoint: tuple[Path, dict[str, Any]],
) -> None:
    ckpt, state = checkpoint
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    doc.pop("checksum")
    doc["version"] = 1
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    assert load_outcome(ckpt, state) == "same"


def test_version_2_manifest_without_checksum_is_refused(
    checkpoint: tuple[Path, dict[str, Any]],
) -> None:
    ckpt, state = checkpoint
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    doc.pop("checksum")
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ss.CorruptCheckpointError, match="checksum"):
        ss.load(blank_like(state), ckpt)

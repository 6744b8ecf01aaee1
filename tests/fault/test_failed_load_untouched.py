"""A load that fails on a corrupt shard leaves the caller's state exactly as it was (issue 12.3)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from snapstate.manager import step_dir
from support.states import assert_same_state, training_state


def _shards(ckpt: Path) -> list[Path]:
    found = sorted((ckpt / "shards").glob("*.safetensors"))
    assert found, f"no shards under {ckpt}"
    return found


def _flip_near_end(shard: Path) -> None:
    """Damage the last stored bytes: every earlier chunk has been read by the time it is found."""
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size - 3)
        byte = f.read(1)
        f.seek(size - 3)
        f.write(bytes([byte[0] ^ 0xFF]))


def _moved_on(state: dict[str, Any]) -> None:
    """Train one more step and change the plain values, so the state differs from the checkpoint."""
    model, optim = state["model"], state["optim"]
    model(torch.randn(8, 32)).sum().backward()
    optim.step()
    state["extra"]["bf16"].add_(1)
    state["extra"]["array"] += 7
    state["epoch"] += 10
    state["name"] = "moved"


def _corrupt_checkpoint(tmp_path: Path, state: dict[str, Any]) -> Path:
    ckpt = tmp_path / "ckpt"
    ss.save(state, ckpt, options=ss.SaveOptions(block_bytes=1024))
    for shard in _shards(ckpt):
        _flip_near_end(shard)
    return ckpt


@pytest.mark.parametrize("read_once", [True, False])
def test_corrupt_shard_leaves_state_bit_identical(tmp_path: Path, read_once: bool) -> None:
    state = training_state()
    ckpt = _corrupt_checkpoint(tmp_path, state)
    _moved_on(state)
    before = copy.deepcopy(state)
    with pytest.raises(ss.CorruptCheckpointError, match="checksum"):
        ss.load(state, ckpt, read_once=read_once)
    assert_same_state(state, before)


def test_failed_load_then_good_load(tmp_path: Path) -> None:
    state = training_state()
    good = copy.deepcopy(state)
    ss.save(state, tmp_path / "good")
    ckpt = _corrupt_checkpoint(tmp_path, state)
    _moved_on(state)
    params = list(state["model"].parameters())
    with pytest.raises(ss.CorruptCheckpointError):
        ss.load(state, ckpt)
    # the same objects, still wired together, and a good checkpoint loads into them exactly
    assert state["optim"].param_groups[0]["params"] == params
    ss.load(state, tmp_path / "good")
    assert_same_state(state, good)


def test_manager_fallback_loads_older_step_exactly(tmp_path: Path) -> None:
    mgr = ss.CheckpointManager(tmp_path / "run", async_save=False)
    state = training_state()
    mgr.save(1, state)
    good = copy.deepcopy(state)
    _moved_on(state)
    mgr.save(2, state)
    for shard in _shards(tmp_path / "run" / step_dir(2)):
        _flip_near_end(shard)
    _moved_on(state)
    assert mgr.restore(state) == 1
    assert 2 in mgr.corrupt_steps
    assert_same_state(state, good)
    mgr.close()


def test_manager_with_no_usable_step_leaves_state_untouched(tmp_path: Path) -> None:
    mgr = ss.CheckpointManager(tmp_path / "run", async_save=False)
    state = training_state()
    mgr.save(1, state)
    for shard in _shards(tmp_path / "run" / step_dir(1)):
        _flip_near_end(shard)
    _moved_on(state)
    before = copy.deepcopy(state)
    assert mgr.restore(state) is None
    assert_same_state(state, before)
    mgr.close()

"""Loading by target: every difference reported at once, non-strict partial loads, extra keys ignored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import snapstate as ss
from support.bits import assert_bitwise_equal


def saved(tmp_path: Path) -> tuple[Path, dict]:
    state = {
        "a": torch.randn(4, 4),
        "b": torch.randn(3),
        "c": torch.arange(5, dtype=torch.int32),
        "arr": np.ones((2, 2), dtype=np.float32),
        "nested": {"x": torch.ones(2), "y": torch.zeros(2)},
        "epoch": 4,
    }
    ss.save(state, tmp_path / "c")
    return tmp_path / "c", state


def mismatched_target() -> dict:
    return {
        "a": torch.zeros(4, 5),  # shape
        "b": torch.zeros(3, dtype=torch.float64),  # dtype
        "c": torch.zeros(5, dtype=torch.int32),  # fine
        "arr": np.zeros((2, 2), dtype=np.float64),  # numpy dtype
        "nested": {"x": torch.zeros(2), "z": torch.zeros(2)},  # z missing in checkpoint
        "gone": torch.zeros(1),  # missing in checkpoint
        "epoch": 0,
    }


def test_incompatible_state_error_lists_every_difference(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    target = mismatched_target()
    with pytest.raises(ss.IncompatibleStateError) as info:
        ss.load(target, path)
    problems = {m.key: m.problem for m in info.value.mismatches}
    assert set(problems) == {"a", "b", "arr", "nested/z", "gone"}
    assert "shape" in problems["a"] and "[4, 5]" in problems["a"] and "[4, 4]" in problems["a"]
    assert "dtype" in problems["b"] and "float64" in problems["b"]
    assert "dtype" in problems["arr"]
    assert sorted(info.value.missing) == ["gone", "nested/z"]
    message = str(info.value)
    assert all(key in message for key in problems) and "5 differences" in message
    # a strict failure changes nothing
    assert not target["c"].any() and target["epoch"] == 0


def test_non_strict_loads_the_matching_part(tmp_path: Path) -> None:
    path, state = saved(tmp_path)
    target = mismatched_target()
    result = ss.load(target, path, strict=False)
    assert_bitwise_equal(target["c"], state["c"])
    assert_bitwise_equal(target["nested"]["x"], state["nested"]["x"])
    assert target["epoch"] == 4
    assert not target["a"].any() and not target["b"].any() and not target["gone"].any()
    assert not target["nested"]["z"].any()
    assert sorted(result.skipped.missing) == ["gone", "nested/z"]
    assert {m.key for m in result.skipped.mismatched} == {"a", "b", "arr", "nested/z", "gone"}


def test_strict_load_reports_nothing_skipped(tmp_path: Path) -> None:
    path, state = saved(tmp_path)
    target = {"a": torch.zeros(4, 4), "b": torch.zeros(3)}
    result = ss.load(target, path)
    assert result.skipped.missing == [] and result.skipped.mismatched == []
    assert result.bytes_read == (16 + 3) * 4


def test_checkpoint_keys_the_target_lacks_are_ignored(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ss.save({"model": model, "optim": opt, "rng": ss.RNGState(), "step": 10}, tmp_path / "c")
    inference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    result = ss.load({"model": inference}, tmp_path / "c")
    assert not result.skipped.mismatched
    for a, b in zip(model.parameters(), inference.parameters()):
        assert_bitwise_equal(b, a)


def test_module_with_a_different_architecture(tmp_path: Path) -> None:
    ss.save({"model": nn.Linear(4, 2)}, tmp_path / "c")
    with pytest.raises(ss.IncompatibleStateError) as info:
        ss.load({"model": nn.Linear(5, 3)}, tmp_path / "c")
    assert {m.key for m in info.value.mismatches} == {"model/weight", "model/bias"}


def test_container_type_mismatches_are_reported(tmp_path: Path) -> None:
    ss.save({"seq": [torch.ones(1), torch.ones(1)], "d": {"k": torch.ones(1)}}, tmp_path / "c")
    target = {"seq": [torch.zeros(1)], "d": torch.zeros(1)}
    with pytest.raises(ss.IncompatibleStateError) as info:
        ss.load(target, tmp_path / "c")
    assert {m.key for m in info.value.mismatches} == {"seq", "d"}


def test_tensor_target_for_a_stateful_checkpoint_is_a_mismatch(tmp_path: Path) -> None:
    ss.save({"m": nn.Linear(2, 2)}, tmp_path / "c")
    with pytest.raises(ss.IncompatibleStateError, match="Stateful"):
        ss.load({"m": torch.zeros(2)}, tmp_path / "c")


def test_missing_checkpoint_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load({"x": torch.zeros(1)}, tmp_path / "nothing")
    (tmp_path / "uncommitted" / "shards").mkdir(parents=True)
    with pytest.raises(ss.CheckpointNotFoundError, match="not committed"):
        ss.load({"x": torch.zeros(1)}, tmp_path / "uncommitted")
    assert issubclass(ss.CheckpointNotFoundError, FileNotFoundError)

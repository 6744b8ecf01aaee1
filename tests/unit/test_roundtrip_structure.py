"""Round trips of state structure: nested containers, awkward keys, JSON values, None."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import snapstate as ss
from support.bits import assert_bitwise_equal, assert_tree_equal


def nested_state() -> dict:
    return {
        "model": {"layers": [{"w": torch.randn(3, 3), "b": torch.zeros(3)} for _ in range(3)]},
        "pair": (torch.arange(4), {"inner": (1, 2.5, "x")}),
        "ints": {0: torch.ones(2), 7: "seven", -3: [None, True]},
        "a/b": torch.full((2,), 5.0),
        "50%/x%2Fy": {"c/d%": 1},
        "empty": {"list": [], "dict": {}, "tuple": ()},
        "values": {"none": None, "t": True, "f": False, "i": -(2**62), "s": "ünï/çødé%", "x": 0.1},
        "specials": [float("nan"), float("inf"), float("-inf"), -0.0],
        "arr": np.arange(6, dtype=np.float64).reshape(2, 3),
    }


def test_nested_state_round_trips_into_none_slots(tmp_path: Path) -> None:
    state = nested_state()
    ss.save(state, tmp_path / "c")
    fresh = {k: None for k in state}
    ss.load(fresh, tmp_path / "c")
    assert_tree_equal(fresh, state)
    assert math.copysign(1.0, fresh["specials"][3]) == -1.0


def test_nested_state_round_trips_in_place(tmp_path: Path) -> None:
    state = nested_state()
    ss.save(state, tmp_path / "c")
    fresh = nested_state()
    tensors_before = [layer["w"] for layer in fresh["model"]["layers"]]
    for t in tensors_before:
        t.zero_()
    fresh["values"]["s"] = "changed"
    fresh["specials"] = [0.0, 0.0, 0.0, 0.0]
    ss.load(fresh, tmp_path / "c")
    assert_tree_equal(fresh, state)
    # tensors are filled in place, never replaced
    assert all(a is b["w"] for a, b in zip(tensors_before, fresh["model"]["layers"]))


def test_slash_and_percent_keys_do_not_collide(tmp_path: Path) -> None:
    state = {
        "a/b": torch.tensor([1.0]),
        "a": {"b": torch.tensor([2.0])},
        "a%2Fb": torch.tensor([3.0]),
    }
    ss.save(state, tmp_path / "c")
    keys = set(ss.inspect(tmp_path / "c").tensors)
    assert len(keys) == 3
    fresh = {"a/b": torch.zeros(1), "a": {"b": torch.zeros(1)}, "a%2Fb": torch.zeros(1)}
    ss.load(fresh, tmp_path / "c")
    assert_tree_equal(fresh, state)


def test_int_and_str_keys_stay_distinct_types(tmp_path: Path) -> None:
    state = {"d": {1: "int one", "2": "str two"}}
    ss.save(state, tmp_path / "c")
    fresh: dict = {"d": None}
    ss.load(fresh, tmp_path / "c")
    assert fresh["d"] == {1: "int one", "2": "str two"}


def test_str_and_int_key_with_same_text_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="same key path"):
        ss.save({"d": {1: torch.zeros(1), "1": torch.ones(1)}}, tmp_path / "c")


def test_manifest_is_strict_json_without_nan(tmp_path: Path) -> None:
    ss.save({"x": float("nan"), "y": [float("inf")]}, tmp_path / "c")
    raw = (tmp_path / "c" / "manifest.json").read_text()
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"manifest holds {c}"))


def test_plain_values_are_replaced(tmp_path: Path) -> None:
    ss.save({"epoch": 3, "name": "run", "cfg": {"lr": 0.1, "steps": [1, 2]}}, tmp_path / "c")
    fresh = {"epoch": 0, "name": "", "cfg": {"lr": 0.0, "steps": [9, 9]}}
    ss.load(fresh, tmp_path / "c")
    assert fresh == {"epoch": 3, "name": "run", "cfg": {"lr": 0.1, "steps": [1, 2]}}


def test_tuples_stay_tuples_and_lists_stay_lists(tmp_path: Path) -> None:
    state = {"t": (1, (2, 3), [4]), "l": [(5,), []]}
    ss.save(state, tmp_path / "c")
    fresh = {"t": None, "l": None}
    ss.load(fresh, tmp_path / "c")
    assert fresh == state
    assert isinstance(fresh["t"][1], tuple) and isinstance(fresh["t"][2], list)


def test_numpy_scalars_inside_tuples_and_lists(tmp_path: Path) -> None:
    state = {"t": (np.float32(1.5), (np.int64(7),)), "l": [np.uint8(3)]}
    ss.save(state, tmp_path / "c")
    fresh: dict = {"t": None, "l": [np.uint8(0)]}
    ss.load(fresh, tmp_path / "c")
    assert_tree_equal(fresh, state)


def test_load_into_a_stateful_root(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    ss.save(model, tmp_path / "c")
    other = torch.nn.Linear(3, 2)
    ss.load(other, tmp_path / "c")
    assert_bitwise_equal(other.weight, model.weight)


def test_load_target_must_be_a_dict_or_stateful(tmp_path: Path) -> None:
    ss.save({"x": torch.ones(1)}, tmp_path / "c")
    with pytest.raises(TypeError, match="dict or a Stateful"):
        ss.load([torch.zeros(1)], tmp_path / "c")


def test_save_returns_a_result_with_figures(tmp_path: Path) -> None:
    result = ss.save({"x": torch.ones(256)}, tmp_path / "c", step=12)
    assert result.step == 12 and result.bytes_written >= 1024 and result.files
    assert ss.inspect(tmp_path / "c").step == 12

"""The shared test support tells apart what the tests need told apart (else they pass vacuously)."""

from __future__ import annotations

import errno
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import snapstate as ss
from snapstate.storage.local import LocalStorage
from support.bits import assert_tree_equal, raw_bytes, same_bits, tree_differences
from support.procs import wait_for
from support.states import assert_same_state, blank_like, training_state
from support.storages import Fault, FaultyStorage, fired
from support.tensors import random_tensor, zeros_like_layout


def test_same_bits_sees_signed_zeros_and_nan_payloads() -> None:
    assert same_bits(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    quiet, other = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert math.isnan(quiet) and math.isnan(other)
    assert same_bits(quiet, quiet.clone()) and not same_bits(quiet, other)
    assert not same_bits(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not same_bits(torch.zeros(2), torch.zeros(1, 2))
    wide = random_tensor(torch.complex128, (3, 2), seed=1)
    assert same_bits(wide, wide.clone()) and not same_bits(wide, zeros_like_layout(wide))


def test_raw_bytes_is_row_major_whatever_the_strides() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    assert raw_bytes(t.t()).tolist() == [0, 0, 3, 0, 1, 0, 4, 0, 2, 0, 5, 0]


def test_tree_differences_names_each_place() -> None:
    a = {"w": torch.ones(2), "n": [1, 2.5, float("nan")], "arr": np.arange(3)}
    b = {"w": torch.ones(2), "n": [1, 2.5, float("nan")], "arr": np.arange(3)}
    assert tree_differences(a, b) == []
    assert_tree_equal(a, b)
    b["w"][0] = 2.0
    b["n"] = (1, 2.5, float("nan"))
    b["arr"] = np.arange(3, dtype=np.int8)
    assert tree_differences(a, b, "s") == [
        "s/w: tensors differ",
        "s/n: list != tuple",
        "s/arr: arrays differ",
    ]
    assert tree_differences({"x": 1, "y": 2}, {"y": 2, "x": 1}) == [
        ": keys ['x', 'y'] != ['y', 'x']"
    ]
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_tree_equal(a, b)


def test_same_state_fails_on_one_changed_optimizer_value() -> None:
    a, b = training_state(seed=0), training_state(seed=0)
    assert_same_state(a, b)
    with torch.no_grad():
        next(iter(b["optim"].state.values()))["exp_avg"].view(-1)[0] += 1
    with pytest.raises(AssertionError, match="optim/"):
        assert_same_state(a, b)


def test_fault_after_bytes_tears_a_shard_and_counts(tmp_path: Path) -> None:
    fault = Fault("write_data", after_bytes=4096, error=errno.ENOSPC)
    storage = FaultyStorage(LocalStorage(str(tmp_path / "c")), fault)
    with pytest.raises(OSError, match="injected in write_data") as info:
        ss.save({"big": torch.randn(64, 64)}, storage)
    assert info.value.errno == errno.ENOSPC and fired([fault]) >= 1
    assert not (tmp_path / "c" / "manifest.json").exists()
    ss.save(
        {"small": torch.ones(4)},
        FaultyStorage(LocalStorage(str(tmp_path / "d")), Fault("write_data", after_bytes=1 << 20)),
    )
    assert ss.verify(tmp_path / "d").ok


def test_wait_for_gives_up_with_what_it_waited_for() -> None:
    wait_for(lambda: True, 0.1, "nothing")
    with pytest.raises(AssertionError, match="waiting for the impossible"):
        wait_for(lambda: False, 0.05, "the impossible")


def test_blank_like_keeps_structure_dtypes_and_plain_values() -> None:
    state = {"w": torch.randn(3, 4).t(), "n": [np.arange(3, dtype=np.int16), (7, "x")]}
    blank = blank_like(state)
    assert tree_differences(blank, state) == ["/w: tensors differ", "/n/0: arrays differ"]
    assert blank["w"].dtype == torch.float32 and blank["w"].shape == (4, 3)
    assert not blank["w"].any() and not blank["n"][0].any() and blank["n"][1] == (7, "x")

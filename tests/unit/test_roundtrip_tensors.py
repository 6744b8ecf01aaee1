"""Round trips of tensors and arrays: save, load into a fresh state, compare bit for bit."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import snapstate as ss
from snapstate.format.dtypes import DTYPES
from support.bits import assert_bitwise_equal, assert_tree_equal
from support.tensors import random_tensor, zeros_like_layout

ALL_DTYPES = sorted(DTYPES)
NUMPY_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]


@pytest.fixture(autouse=True)
def _quiet_complex32():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def roundtrip(state: dict, path: Path) -> dict:
    """Save ``state``, load into zero tensors of the same layout, return the loaded state."""
    ss.save(state, path)
    fresh = {k: zeros_like_layout(v) for k, v in state.items()}
    ss.load(fresh, path)
    return fresh


def test_every_dtype_round_trips_bitwise(tmp_path: Path) -> None:
    state = {name: random_tensor(DTYPES[name], (3, 5), seed=i) for i, name in enumerate(ALL_DTYPES)}
    loaded = roundtrip(state, tmp_path / "ckpt")
    for name in ALL_DTYPES:
        assert_bitwise_equal(loaded[name], state[name])
    manifest = ss.inspect(tmp_path / "ckpt")
    assert {k: r.dtype for k, r in manifest.tensors.items()} == {n: n for n in ALL_DTYPES}


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_every_dtype_non_contiguous_and_scalar(tmp_path: Path, name: str) -> None:
    dtype = DTYPES[name]
    base = random_tensor(dtype, (6, 8), seed=1)
    state = {
        "transposed": base.t(),
        "strided": base[1::2, ::3],
        "scalar": random_tensor(dtype, (), seed=2),
        "empty": torch.zeros((0, 16), dtype=torch.uint8).view(dtype),
    }
    assert not state["transposed"].is_contiguous() and not state["strided"].is_contiguous()
    loaded = roundtrip(state, tmp_path / "ckpt")
    for key, value in state.items():
        assert_bitwise_equal(loaded[key], value)
    assert loaded["scalar"].dim() == 0


def test_special_float_values_keep_their_bits(tmp_path: Path) -> None:
    payload_nan = torch.tensor([0x7FC01234], dtype=torch.int32).view(torch.float32)
    values = torch.cat(
        [torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]), payload_nan]
    )
    loaded = roundtrip({"x": values, "h": values.half(), "b": values.bfloat16()}, tmp_path / "c")
    assert_bitwise_equal(loaded["x"], values)
    assert_bitwise_equal(loaded["h"], values.half())
    assert_bitwise_equal(loaded["b"], values.bfloat16())


def test_zero_size_tensors_of_many_shapes(tmp_path: Path) -> None:
    state = {
        "a": torch.empty(0),
        "b": torch.empty(3, 0, 2, dtype=torch.int64),
        "c": torch.empty(0, 0, dtype=torch.bool),
    }
    loaded = roundtrip(state, tmp_path / "c")
    for key, value in state.items():
        assert loaded[key].shape == value.shape and loaded[key].dtype == value.dtype
    assert ss.verify(tmp_path / "c").ok


def test_zero_d_scalars(tmp_path: Path) -> None:
    state = {
        "f": torch.tensor(3.5),
        "i": torch.tensor(-7, dtype=torch.int64),
        "b": torch.tensor(True),
    }
    loaded = roundtrip(state, tmp_path / "c")
    for key, value in state.items():
        assert loaded[key].dim() == 0
        assert_bitwise_equal(loaded[key], value)


def test_views_sharing_storage_save_only_their_bytes(tmp_path: Path) -> None:
    base = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB storage
    state = {"head": base[:10], "tail_strided": base[-64::4].view(4, 4)}
    loaded = roundtrip(state, tmp_path / "c")
    assert_bitwise_equal(loaded["head"], base[:10])
    assert_bitwise_equal(loaded["tail_strided"], base[-64::4].view(4, 4))
    manifest = ss.inspect(tmp_path / "c")
    assert manifest.totals["tensor_bytes"] == (10 + 16) * 4
    shard_bytes = sum(f.stat().st_size for f in (tmp_path / "c" / "shards").iterdir())
    assert shard_bytes < 4096, "the whole base storage was written"


def test_two_names_for_the_same_tensor(tmp_path: Path) -> None:
    t = torch.randn(5, 3)
    ss.save({"a": t, "b": t, "c": t[1]}, tmp_path / "c")
    fresh = {"a": torch.zeros(5, 3), "b": torch.zeros(5, 3), "c": torch.zeros(3)}
    ss.load(fresh, tmp_path / "c")
    assert_bitwise_equal(fresh["a"], t)
    assert_bitwise_equal(fresh["b"], t)
    assert_bitwise_equal(fresh["c"], t[1])


def test_tensor_requiring_grad_loads_in_place(tmp_path: Path) -> None:
    w = torch.randn(4, 4, requires_grad=True)
    ss.save({"w": w}, tmp_path / "c")
    target = torch.zeros(4, 4, requires_grad=True)
    storage_before = target.data_ptr()
    ss.load({"w": target}, tmp_path / "c")
    assert target.requires_grad and target.data_ptr() == storage_before
    assert_bitwise_equal(target, w)


def test_load_fills_a_non_contiguous_target_in_place(tmp_path: Path) -> None:
    src = torch.randn(6, 4)
    ss.save({"x": src}, tmp_path / "c")
    holder = torch.zeros(4, 6)
    target = holder.t()
    ss.load({"x": target}, tmp_path / "c")
    assert_bitwise_equal(holder.t(), src)


def test_none_slots_receive_newly_allocated_values(tmp_path: Path) -> None:
    state = {"t": torch.randn(3), "a": np.arange(4, dtype=np.int16), "s": np.float32(2.5)}
    ss.save(state, tmp_path / "c")
    fresh: dict = {"t": None, "a": None, "s": None}
    ss.load(fresh, tmp_path / "c")
    assert_tree_equal(fresh, state)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_of_every_numeric_dtype(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=4 * 6 * np.dtype(dtype).itemsize, dtype=np.uint8)
    arr = raw.view(dtype).reshape(4, 6)
    state = {
        "arr": arr,
        "fortran": np.asfortranarray(arr),
        "reversed": arr[::-1, ::2],
        "zero_d": np.array(arr[0, 0]),
    }
    ss.save(state, tmp_path / "c")
    fresh = {k: np.zeros_like(v) for k, v in state.items()}
    ss.load(fresh, tmp_path / "c")
    for key, value in state.items():
        assert fresh[key].dtype == value.dtype and fresh[key].shape == value.shape
        assert fresh[key].tobytes() == value.tobytes(), key
    assert ss.inspect(tmp_path / "c").tensors["arr"].kind == "ndarray"


def test_big_endian_numpy_array_round_trips_by_value(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=">i4").reshape(3, 4)
    ss.save({"a": arr}, tmp_path / "c")
    fresh: dict = {"a": None}
    ss.load(fresh, tmp_path / "c")
    np.testing.assert_array_equal(fresh["a"], arr)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_scalars_of_every_dtype(tmp_path: Path, dtype: str) -> None:
    value = np.array([1], dtype=np.uint8).astype(dtype)[0] if dtype != "bool" else np.bool_(True)
    ss.save({"s": value}, tmp_path / "c")
    fresh = {"s": np.zeros((), dtype=dtype)[()]}
    ss.load(fresh, tmp_path / "c")
    assert isinstance(fresh["s"], np.generic) and fresh["s"].dtype == value.dtype
    assert fresh["s"] == value


def test_many_tensors_and_block_boundaries(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(i * 37 + 1) for i in range(50)}
    options = ss.SaveOptions(block_bytes=256, piece_bytes=1000)
    ss.save(state, tmp_path / "c", options=options)
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    ss.load(fresh, tmp_path / "c")
    for key, value in state.items():
        assert_bitwise_equal(fresh[key], value)
    assert ss.verify(tmp_path / "c").chunks == 50


def test_large_tensor_split_in_chunks_round_trips(tmp_path: Path) -> None:
    big = torch.randn(512, 256)  # 512 KiB, split in 64 KiB chunks and 4 KiB blocks
    options = ss.SaveOptions(
        block_bytes=4096,
        piece_bytes=20000,
        plan=ss.PlanOptions(chunk_bytes=1 << 16, max_file_bytes=1 << 18),
    )
    ss.save({"big": big}, tmp_path / "c", options=options)
    manifest = ss.inspect(tmp_path / "c")
    assert len(manifest.tensors["big"].chunks) == 8 and len(manifest.files) >= 2
    target = torch.zeros(512, 256)
    ss.load({"big": target}, tmp_path / "c")
    assert_bitwise_equal(target, big)

"""Values that cannot be saved: a TypeError naming the key path, and nothing committed."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import snapstate as ss
from support.bits import assert_bitwise_equal


class Opaque:
    pass


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated, still creatable
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.randn(4), scale=0.1, zero_point=0, dtype=torch.qint8)


BAD_VALUES = {
    "lambda": lambda: lambda x: x,
    "module_in_a_set": lambda: {1, Opaque()},
    "object": lambda: Opaque(),
    "bytes": lambda: b"raw",
    "complex": lambda: 1 + 2j,
    "class": lambda: Opaque,
    "quantized": quantized,
    "sparse": lambda: torch.eye(3).to_sparse(),
    "np_object": lambda: np.array([{"a": 1}, None], dtype=object),
    "np_str": lambda: np.array(["a", "b"]),
    "np_datetime": lambda: np.array(["2024-01-01"], dtype="datetime64[D]"),
    "np_longdouble": lambda: np.ones(2, dtype=np.longdouble),
    "np_object_scalar": lambda: np.str_("text"),
}


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_type_error_names_the_key_path(tmp_path: Path, kind: str) -> None:
    state = {"model": {"layers": [torch.ones(1), {"odd/name": BAD_VALUES[kind]()}]}}
    with pytest.raises(TypeError) as info:
        ss.save(state, tmp_path / "c")
    assert "model/layers/1/odd%2Fname" in str(info.value)
    assert not (tmp_path / "c" / "manifest.json").exists()


@pytest.mark.parametrize("key", [1.5, (1, 2), None, True])
def test_non_str_int_dict_keys_are_rejected(tmp_path: Path, key: object) -> None:
    with pytest.raises(TypeError, match="outer"):
        ss.save({"outer": {key: 1}}, tmp_path / "c")


def test_unsaveable_inside_a_stateful_object(tmp_path: Path) -> None:
    class Holder:
        def state_dict(self) -> dict:
            return {"fine": 1, "bad": {3, 4j}}

        def load_state_dict(self, d: dict) -> None:
            pass

    with pytest.raises(TypeError, match="holder/bad"):
        ss.save({"holder": Holder()}, tmp_path / "c")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    good = {"w": torch.randn(8)}
    ss.save(good, tmp_path / "c")
    for call in (ss.save, ss.async_save):
        with pytest.raises(TypeError):
            call({"w": torch.randn(8), "bad": object()}, tmp_path / "c", overwrite=True)
        target = {"w": torch.zeros(8)}
        ss.load(target, tmp_path / "c")
        assert_bitwise_equal(target["w"], good["w"])


def test_async_save_raises_type_error_before_returning(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="x"):
        ss.async_save({"x": {1, 2j}}, tmp_path / "c")
    # the failed call left no save in flight
    handle = ss.async_save({"x": torch.ones(2)}, tmp_path / "d")
    handle.wait()

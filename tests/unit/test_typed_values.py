"""Typed values (dtype, device, Size, Path, Namespace, Enum, datetime, sets) come back as
their types, without pickle; what cannot be stored is refused naming its key."""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import json
import sys
import types
import zoneinfo
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import pytest
import torch
from torch import nn

import snapstate as ss
from snapstate.format.manifest import seal


class Color(enum.Enum):
    RED = 1
    BLUE = "b"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def values() -> dict[str, Any]:
    return {
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "tuple": (1, (2, "a"), []),
        "path": Path("/data/run1"),
        "posix": PurePosixPath("a/b"),
        "windows": PureWindowsPath("C:/a/b"),
        "ns": argparse.Namespace(lr=0.1, t=torch.arange(3), sub=argparse.Namespace(a=[1])),
        "color": Color.BLUE,
        "level": Level.HIGH,
        "utc": dt.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc),
        "offset": dt.datetime(2024, 1, 2, tzinfo=dt.timezone(dt.timedelta(hours=-5))),
        "naive": dt.datetime(2024, 1, 2),
        "day": dt.date(2024, 5, 6),
        "time": dt.time(1, 2, 3),
        "delta": dt.timedelta(days=1, seconds=3, microseconds=7),
        "set": {3, 1, "a", (1, 2), frozenset({4})},
        "frozen": frozenset({1.5, 2}),
        "empty": set(),
    }


def assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, argparse.Namespace):
        assert sorted(vars(got)) == sorted(vars(want))
        for k in vars(want):
            assert_same(getattr(got, k), getattr(want, k))
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want


def test_typed_values_come_back_as_their_types(tmp_path: Path) -> None:
    ss.save({"hp": values()}, tmp_path / "c")
    read = ss.read_state(tmp_path / "c")["hp"]
    target: dict[str, Any] = {"hp": dict.fromkeys(values())}
    ss.load(target, tmp_path / "c")
    for key, want in values().items():
        assert_same(read[key], want)
        assert_same(target["hp"][key], want)
    assert read["utc"].tzinfo == dt.timezone.utc


def test_a_dtype_in_param_groups_round_trips(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["dtype"] = torch.bfloat16  # as timm's adafactorbv keeps it
    ss.save({"optim": opt}, tmp_path / "c")
    fresh = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5)
    ss.load({"optim": fresh}, tmp_path / "c")
    assert fresh.param_groups[0]["dtype"] is torch.bfloat16
    assert fresh.param_groups[0]["lr"] == 0.1


def _enum_in_a_module_of_its_own() -> type[enum.Enum]:
    module = types.ModuleType("snapstate_test_enums")
    shade = enum.Enum("Shade", {"DARK": 1, "LIGHT": 2}, module=module.__name__)
    module.Shade = shade  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    return shade


def test_an_enum_is_restored_only_from_a_class_already_imported(tmp_path: Path) -> None:
    shade = _enum_in_a_module_of_its_own()
    ss.save({"hp": {"shade": shade.LIGHT}}, tmp_path / "c")
    manifest_text = (tmp_path / "c" / "manifest.json").read_text()
    assert "snapstate_test_enums:Shade" in manifest_text
    assert ss.read_state(tmp_path / "c")["hp"]["shade"] is shade.LIGHT
    del sys.modules["snapstate_test_enums"]
    with pytest.raises(ss.IncompatibleStateError, match="hp/shade: .*not imported"):
        ss.read_state(tmp_path / "c")
    with pytest.raises(ss.IncompatibleStateError, match="not imported"):
        ss.load({"hp": {"shade": None}}, tmp_path / "c")
    assert "snapstate_test_enums" not in sys.modules  # loading imported nothing
    target = {"hp": {"shade": shade.DARK}}  # the target's own member names the class
    ss.load(target, tmp_path / "c")
    assert target["hp"]["shade"] is shade.LIGHT


def test_an_enum_value_its_class_lacks_is_refused(tmp_path: Path) -> None:
    ss.save({"c": Color.RED}, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    del manifest["checksum"]
    ((_, node),) = manifest["tree"]["d"]
    assert node == {"x": "enum", "v": f"{__name__}:Color", "c": {"v": 1}}
    node["c"] = {"v": 9}
    (tmp_path / "c" / "manifest.json").write_bytes(seal(json.dumps(manifest).encode()))
    with pytest.raises(ss.IncompatibleStateError, match="c: enum .*Color has no member of value 9"):
        ss.load({"c": Color.BLUE}, tmp_path / "c")


@pytest.mark.parametrize(
    "state, key",
    [
        ({"hp": {"loss": nn.MSELoss()}}, "hp/loss"),
        ({"hp": {"when": dt.datetime(2024, 1, 1, tzinfo=zoneinfo.ZoneInfo("UTC"))}}, "hp/when"),
        ({"s": {torch.ones(1).sum().item(), 2j}}, "s"),
        ({"s": {nn.Linear(1, 1)}}, "s"),
        ({"e": {"x": [object()]}}, "e/x/0"),
    ],
)
def test_what_cannot_be_stored_is_refused_by_key(tmp_path: Path, state: Any, key: str) -> None:
    with pytest.raises(TypeError, match=f"'{key}"):
        ss.save(state, tmp_path / "c")
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_a_stateful_inside_a_state_dict_loads_in_place(tmp_path: Path) -> None:
    # RankLocal(loader) is the common case: the target's state dict hands the live object back
    saved = nn.Linear(2, 2)
    ss.save({"wrapped": ss.RankLocal({"net": saved})}, tmp_path / "c")
    net = nn.Linear(2, 2)
    wrapper = ss.RankLocal({"net": net})
    ss.load({"wrapped": wrapper}, tmp_path / "c")
    assert wrapper.value["net"] is net
    assert torch.equal(net.weight, saved.weight) and torch.equal(net.bias, saved.bias)

"""A Stateful whose load_state_dict raises: the load is undone, whole (issue 31 item 4).

Before: tensors, plain values and the Stateful objects loaded before it were already replaced,
and the user's exception escaped ``mgr.restore`` raw. Now every change is put back and a
StateRestoreError (a CheckpointError) carries the user's exception as its cause; the manager
does not set the step aside, since the checkpoint is fine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import snapstate as ss


class Picky:
    """A user's Stateful that changes itself, then refuses a value it does not accept."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.history = [value]
        self.accepts = {value}
        self.refuse = False

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["value"]  # half-applied before the refusal
        self.history.append(-1)
        if self.refuse and sd["value"] not in self.accepts:
            raise ValueError("value out of range for this run")
        self.history = list(sd["history"])


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = nn.Linear(4, 3)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "w": torch.randn(16),
        "cfg": {"lr": 0.1 * seed, "name": f"run{seed}"},
        "net": net,
        "opt": opt,
        "picky": Picky(seed),  # last: the objects before it were loaded when it raises
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "w": state["w"].clone(),
        "cfg": dict(state["cfg"]),
        "net": {k: v.clone() for k, v in state["net"].state_dict().items()},
        "opt": {
            i: {k: v.clone() for k, v in s.items()}
            for i, s in state["opt"].state_dict()["state"].items()
        },
        "picky": (state["picky"].value, list(state["picky"].history)),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["w"], b["w"])
    assert a["cfg"] == b["cfg"]
    assert a["net"].keys() == b["net"].keys()
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])
    assert a["opt"].keys() == b["opt"].keys()
    for i in a["opt"]:
        assert all(torch.equal(a["opt"][i][k], b["opt"][i][k]) for k in a["opt"][i])
    assert a["picky"] == b["picky"]


def test_a_refused_load_leaves_every_part_of_the_state_as_it_was(tmp_path: Path) -> None:
    ss.save(make_state(1), tmp_path / "c")
    state = make_state(2)
    state["picky"].refuse = True
    before = snapshot(state)
    with pytest.raises(ss.StateRestoreError, match="'picky'.*out of range") as info:
        ss.load(state, tmp_path / "c")
    assert isinstance(info.value, ss.CheckpointError) and info.value.key == "picky"
    assert isinstance(info.value.__cause__, ValueError)
    assert_same(snapshot(state), before)
    state["picky"].refuse = False  # the same target then loads
    ss.load(state, tmp_path / "c")
    assert_same(snapshot(state), snapshot(make_state(1)))


def test_the_manager_raises_it_and_keeps_the_step(tmp_path: Path) -> None:
    with ss.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(3))
    state = make_state(2)
    state["picky"].refuse = True
    before = snapshot(state)
    with ss.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(ss.StateRestoreError) as info:
            mgr.restore(state)
        assert isinstance(info.value.__cause__, ValueError)
        assert_same(snapshot(state), before)
        assert mgr.steps() == [1, 2] and not mgr.corrupt_steps  # not damage: nothing set aside
        assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir()) == [
            "step-000000001",
            "step-000000002",
        ]
        state["picky"].refuse = False
        assert mgr.restore(state) == 2
    assert_same(snapshot(state), snapshot(make_state(3)))

"""A very deep stored structure is refused with a clear CheckpointError, never a RecursionError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from snapstate.format.tree import MAX_TREE_DEPTH
from snapstate.state.restore import plan_materialize


def _nested(depth: int, leaf: Any) -> dict[str, Any]:
    tree: Any = leaf
    for _ in range(depth):
        tree = {"a": tree}
    return tree


def _deep_node(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"v": 1}
    for _ in range(depth):
        node = {"d": [["a", node]]}
    return node


def test_plan_refuses_a_100k_level_tree() -> None:
    with pytest.raises(ss.NestingLimitError, match=f"deeper than {MAX_TREE_DEPTH}") as info:
        plan_materialize({"d": [["a", _deep_node(100_000)]]}, lambda k, r: None, None)
    assert "manifest.json" in str(info.value)
    assert len(str(info.value)) < 1000  # the key path is shown shortened


@pytest.mark.parametrize("depth", [MAX_TREE_DEPTH + 50, 100_000])
def test_load_refuses_a_deep_manifest(tmp_path: Path, depth: int) -> None:
    ckpt = tmp_path / "ckpt"
    state = {"w": torch.arange(6.0), "epoch": 1}
    ss.save(state, ckpt)
    doc = json.loads((ckpt / "manifest.json").read_text())
    deep = '{"d": [["a", ' * depth + '{"v": 1}' + "]]}" * depth
    tree = json.dumps(doc["tree"])
    assert tree.endswith("]}")
    doc_text = json.dumps({**doc, "tree": "@TREE@"}).replace(
        '"@TREE@"', tree[: -len("]}")] + ', ["deep", ' + deep + "]]}"
    )
    (ckpt / "manifest.json").write_text(doc_text)
    # a plain value slot takes the stored structure whole, so the walk goes all the way down
    target = {"w": torch.zeros(6), "epoch": 0, "deep": None}
    with pytest.raises(ss.CheckpointError):
        ss.load(target, ckpt)
    assert target == {"w": target["w"], "epoch": 0, "deep": None}
    assert not target["w"].any()


def test_real_deep_state_round_trips(tmp_path: Path) -> None:
    depth = MAX_TREE_DEPTH // 2
    state = _nested(depth, {"w": torch.arange(4.0), "n": 3})
    ss.save(state, tmp_path / "ckpt")
    target = _nested(depth, {"w": torch.zeros(4), "n": 0})
    ss.load(target, tmp_path / "ckpt")
    leaf = target
    for _ in range(depth):
        leaf = leaf["a"]
    assert leaf["n"] == 3 and torch.equal(leaf["w"], torch.arange(4.0))


def test_a_rank_local_state_counts_its_levels_as_load_does(tmp_path: Path) -> None:
    deepest = MAX_TREE_DEPTH
    while True:
        state = _nested(deepest, {"rng": ss.RankLocal({"seed": 5})})
        try:
            ss.save(state, tmp_path / f"rl-{deepest}")
            break
        except ss.NestingLimitError:
            deepest -= 1
    target = _nested(deepest, {"rng": ss.RankLocal({"seed": 0})})
    ss.load(target, tmp_path / f"rl-{deepest}")
    leaf = target
    for _ in range(deepest):
        leaf = leaf["a"]
    assert leaf["rng"].value == {"seed": 5}


# Issue 31 item 1: one nesting limit for save and load; a limit is not damage.


def _save_accepts(tmp_path: Path, depth: int) -> bool:
    try:
        ss.save(_nested(depth, {"n": 3}), tmp_path / f"probe-{depth}")
    except ss.CheckpointError:
        return False
    return True


@pytest.mark.parametrize("depth", [MAX_TREE_DEPTH + 50, 480, 5_000])
def test_save_refuses_a_state_too_deep_to_load_before_writing(tmp_path: Path, depth: int) -> None:
    ckpt = tmp_path / "ckpt"
    with pytest.raises(ss.NestingLimitError, match=f"deeper than {MAX_TREE_DEPTH}") as info:
        ss.save(_nested(depth, {"w": torch.ones(3), "n": 3}), ckpt)
    assert "a/a/a" in str(info.value), "the error names the key path"
    assert not ckpt.exists() or not any(ckpt.iterdir()), "nothing written"


def test_save_accepts_exactly_what_load_accepts(tmp_path: Path) -> None:
    deepest = MAX_TREE_DEPTH
    while not _save_accepts(tmp_path, deepest):
        deepest -= 1
    assert deepest > MAX_TREE_DEPTH // 2
    assert not _save_accepts(tmp_path, deepest + 1)
    target = _nested(deepest, {"n": 0})
    ss.load(target, tmp_path / f"probe-{deepest}")
    leaf = target
    for _ in range(deepest):
        leaf = leaf["a"]
    assert leaf == {"n": 3}


def test_restore_does_not_set_aside_a_step_over_the_limit(tmp_path: Path) -> None:
    """A step saved by an older snapstate deeper than the limit is not damaged: restore
    skips it with a warning and keeps it, and the step before it is restored."""
    from fault.corrupt import edit_manifest

    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(3), "deep": 1})
        mgr.save(2, {"w": torch.full((3,), 2.0), "deep": 2})
    deep = _deep_node(MAX_TREE_DEPTH + 50)

    def deepen(doc: dict[str, Any]) -> None:
        doc["tree"]["d"] = [[k, deep if k == "deep" else v] for k, v in doc["tree"]["d"]]

    edit_manifest(tmp_path / "step-000000002", deepen)
    target = {"w": torch.zeros(3), "deep": None}
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.restore(target) == 1
        assert "NestingLimitError" in mgr.corrupt_steps[2]
        assert mgr.steps() == [1, 2], "the deep step is kept"
    assert not list(tmp_path.glob("*.corrupt*"))
    assert target["deep"] == 1 and torch.equal(target["w"], torch.ones(3))

"""A very deep stored structure is refused with a clear CheckpointError, never a RecursionError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from snapstate.state.restore import MAX_TREE_DEPTH, plan_materialize


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
    with pytest.raises(ss.CorruptCheckpointError, match=f"deeper than {MAX_TREE_DEPTH}") as info:
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


def test_real_state_deeper_than_the_limit_is_refused_on_load(tmp_path: Path) -> None:
    depth = MAX_TREE_DEPTH + 20
    ss.save(_nested(depth, {"n": 3}), tmp_path / "ckpt")
    target = _nested(depth, {"n": 0})
    with pytest.raises(ss.CorruptCheckpointError, match="nested deeper"):
        ss.load(target, tmp_path / "ckpt")

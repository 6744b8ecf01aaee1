"""Tensors that share their bytes (tied weights, aliases) are written once and load back shared."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import snapstate as ss
from support.bits import same_bits


class Tied(nn.Module):
    """An embedding whose output head is the same parameter, as GPT-2 ties lm_head and wte."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight


def test_a_tied_weight_is_written_once_and_loads_back_tied(tmp_path: Path) -> None:
    model = Tied()
    ss.save({"model": model}, tmp_path / "c")
    manifest = ss.inspect(tmp_path / "c")
    assert sorted(manifest.tensors) == ["model/emb.weight"]
    assert manifest.totals["tensor_bytes"] == 64 * 16 * 4  # once
    fresh = Tied()
    ss.load({"model": fresh}, tmp_path / "c")
    assert fresh.head.weight is fresh.emb.weight
    assert same_bits(fresh.emb.weight, model.emb.weight)
    read = ss.read_state(tmp_path / "c")["model"]
    assert read["head.weight"] is read["emb.weight"]  # shared in a plain read too
    assert same_bits(read["head.weight"], model.emb.weight)


def test_an_untied_target_gets_the_bytes_in_both_places(tmp_path: Path) -> None:
    model = Tied()
    ss.save({"model": model.state_dict()}, tmp_path / "c")
    target = {"emb.weight": torch.zeros(64, 16), "head.weight": torch.zeros(64, 16)}
    ss.load({"model": target}, tmp_path / "c")
    assert same_bits(target["emb.weight"], model.emb.weight)
    assert same_bits(target["head.weight"], model.emb.weight)


def test_only_the_same_bytes_in_the_same_shape_are_aliases(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    state = {
        "base": base,
        "same": base.view(4, 6),
        "detached": base.detach(),
        "rows": base[1:],  # another offset
        "t": base.t(),  # another stride
        "flat": base.view(24),  # another shape
        "copy": base.clone(),
    }
    ss.save(state, tmp_path / "c")
    manifest = ss.inspect(tmp_path / "c")
    assert sorted(manifest.tensors) == ["base", "copy", "flat", "rows", "t"]
    tree = json.loads((tmp_path / "c" / "manifest.json").read_text())["tree"]
    assert dict(tree["d"])["same"] == {"a": "base"} and dict(tree["d"])["detached"] == {"a": "base"}
    read = ss.read_state(tmp_path / "c")
    assert read["same"] is read["base"] and read["detached"] is read["base"]
    for key, value in state.items():
        assert same_bits(read[key], value), key

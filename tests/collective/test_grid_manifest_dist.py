"""A grid-form manifest (format version 5) of a real 2-rank save: both ranks' files in one
grid, loaded bitwise on 2 ranks and on 1, verified, with the same chunks as the list form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.format import grid
from snapstate.format.manifest import parse_manifest

from .launch import RankServer
from .scen_grid import full

pytestmark = pytest.mark.dist


def test_two_rank_grid_manifest_loads_bitwise(
    ranks: RankServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    results = ranks.run("collective.scen_grid:save", 2, {"path": str(path)}, tmp_path / "r").check()
    assert all(r["same"] for r in results)
    doc = json.loads((path / "manifest.json").read_bytes())
    assert doc["version"] == 5
    for key in ("w", "s"):
        record = doc["tensors"][key]
        assert "grid" in record and set(record["file"]) == {0, 1}, key  # both ranks' files
    assert len(doc["tensors"]["s"]["grid"][1]) == 3  # columns cut between the two shards
    state = ss.read_state(path)  # on one rank: a resharding load
    assert all(torch.equal(state[k], t) for k, t in full().items())
    assert ss.verify(path).ok
    manifest = ss.inspect(path)
    monkeypatch.setattr(grid, "GRID_MIN_CHUNKS", 1 << 30)
    assert parse_manifest(manifest.to_json()).tensors == manifest.tensors

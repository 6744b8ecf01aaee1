"""Incremental saves across ranks: saved by a manager on 2 ranks, each rank referencing its
unchanged chunks in the previous step, then loaded resharded on 3 ranks and on 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import snapstate as ss

from .launch import RankServer

pytestmark = pytest.mark.dist

STEPS = [1, 2, 3]


def test_incremental_saves_on_2_ranks_load_resharded(ranks: RankServer, tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    layout = {"frozen": "S0", "emb": "R", "head": "S1"}
    results = ranks.run(
        "collective.scen_incremental:save",
        2,
        {"root": root, "layout": layout, "steps": STEPS, "async": True},
        tmp_path / "save",
    ).check()
    docs = {
        s: json.loads((tmp_path / "root" / f"step-{s:09d}" / "manifest.json").read_bytes())
        for s in STEPS
    }
    assert docs[1]["version"] == 2 and docs[3]["version"] == 4
    frozen = docs[3]["tensors"]["params/frozen"]["chunks"]
    assert len(frozen) == 2 and all(c["file"].startswith("../step-000000001/") for c in frozen)
    trained = [c for k in ("params/emb", "params/head") for c in docs[3]["tensors"][k]["chunks"]]
    assert not any(c["file"].startswith("../") for c in trained)
    frozen_bytes = 240 * 64 * 4
    for rank in (0, 1):
        first, third = results[rank]["written"]["1"], results[rank]["written"]["3"]
        assert third is not None and first is not None and third < first
    total = {s: sum(r["written"][str(s)] for r in results) for s in (1, 3)}
    assert total[1] - total[3] >= frozen_bytes  # the frozen bytes were not written again
    for s in STEPS:
        assert ss.verify(f"{root}/step-{s:09d}").ok
    for world, new_layout in ((3, {"frozen": "S1", "emb": "S0", "head": "R"}), (1, layout)):
        loaded = ranks.run(
            "collective.scen_incremental:load",
            world,
            {"root": root, "layout": new_layout, "steps": [2, 3]},
            tmp_path / f"load{world}",
        ).check()
        for r in loaded:
            for case, got in r.items():
                assert all(got["equal"].values()), (world, case, got)
                assert got["step"] == int(case.split()[0])

"""DTensor (1-D and 2-D meshes, uneven shards) and FSDP2: save on N ranks, load on M, bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import snapstate as ss
from snapstate.cli import main as cli
from support.bits import same_bits

from .launch import RankServer
from .scen_dtensor import SPECS, full

pytestmark = pytest.mark.dist

UNIQUE_BYTES = sum(full(k).numel() * full(k).element_size() for k in SPECS)


def _check_load(results: list[dict[str, Any]], layout: dict[str, list[str]]) -> None:
    for r in results:
        for mode in ("read_once=False", "read_once=True"):
            assert all(r[mode]["equal"].values()), (mode, r[mode]["equal"])
            assert r[mode]["bytes_read"] <= r["need"], (mode, r[mode]["bytes_read"], r["need"])
        # sanity: it did read its part
        assert r["read_once=False"]["bytes_read"] >= r["local_bytes"] - 64 * len(SPECS)
        assert r["read_once=False"]["bytes_read"] + 0 >= r["read_once=True"]["bytes_read"]
    assert sum(r["read_once=True"]["bytes_read"] for r in results) <= sum(
        r["read_once=False"]["bytes_read"] for r in results
    )


def _check_plain(path: str) -> None:
    state = {"params": {k: torch.zeros(SPECS[k][0], dtype=SPECS[k][1]) for k in SPECS}}
    ss.load(state, path)
    assert all(same_bits(state["params"][k], full(k)) for k in SPECS)
    value = ss.read_state(path)
    assert all(same_bits(value["params"][k], full(k)) for k in SPECS)
    out = str(Path(path).parent / "export.safetensors")
    # consolidated to one file
    result = CliRunner().invoke(cli, ["export", path, "--to", "safetensors", out])
    assert result.exit_code == 0, result.output
    exported = load_file(out)
    assert all(same_bits(exported[f"params/{k}"], full(k)) for k in SPECS)


def _check_saved(path: str, world: int) -> None:
    manifest = ss.inspect(path)
    assert manifest.world_size == world
    assert manifest.totals["tensor_bytes"] == UNIQUE_BYTES  # each unique shard written once
    assert {r.placement for r in manifest.tensors.values()} == {"shard"}
    assert ss.verify(path).ok


def test_shard0_on_2_ranks_to_shard1_on_3_ranks_to_one_process(
    ranks: RankServer, tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    saved = {"a": ["S0"], "u": ["S0"], "r": ["R"], "c": ["S1"], "t": ["S0"]}
    ranks.run(
        "collective.scen_dtensor:save",
        2,
        {"path": path, "mesh": [2], "layout": saved},
        tmp_path / "save",
    ).check()
    _check_saved(path, 2)
    loaded = {"a": ["S1"], "u": ["S0"], "r": ["S0"], "c": ["R"], "t": ["R"]}
    results = ranks.run(
        "collective.scen_dtensor:load",
        3,
        {"path": path, "mesh": [3], "layout": loaded},
        tmp_path / "load",
    ).check()
    _check_load(results, loaded)
    assert results[0]["read_once=True"]["placements"]["a"] == ["S(1)"]
    _check_plain(path)


def test_2d_mesh_on_4_ranks_to_2_and_3_ranks(ranks: RankServer, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = {
        "a": ["S0", "S1"],
        "u": ["S0", "S1"],
        "r": ["R", "S0"],
        "c": ["S1", "R"],
        "t": ["R", "R"],
    }
    results = ranks.run(
        "collective.scen_dtensor:save",
        4,
        {"path": path, "mesh": [2, 2], "layout": saved},
        tmp_path / "save",
    ).check()
    _check_saved(path, 4)
    # replicas along a mesh dimension were compared
    assert all(r["replica_check_s"] > 0 for r in results)
    on_2 = {"a": ["S1"], "u": ["R"], "r": ["S0"], "c": ["S0"], "t": ["S0"]}
    _check_load(
        ranks.run(
            "collective.scen_dtensor:load",
            2,
            {"path": path, "mesh": [2], "layout": on_2},
            tmp_path / "load2",
        ).check(),
        on_2,
    )
    on_2x2 = {
        "a": ["S1", "S0"],
        "u": ["R", "S1"],
        "r": ["S0", "R"],
        "c": ["R", "R"],
        "t": ["S0", "R"],
    }
    _check_load(
        ranks.run(
            "collective.scen_dtensor:load",
            4,
            {"path": path, "mesh": [2, 2], "layout": on_2x2},
            tmp_path / "load4",
        ).check(),
        on_2x2,
    )
    _check_plain(path)


def test_fsdp2_model_and_optimizer_2_ranks_to_3_ranks_to_one_process(
    ranks: RankServer, tmp_path: Path
) -> None:
    args = {"path": str(tmp_path / "ckpt"), "reference": str(tmp_path / "reference.safetensors")}
    saved = ranks.run("collective.scen_fsdp:save", 2, args, tmp_path / "save").check()
    manifest = ss.inspect(args["path"])
    shard_bytes = sum(r.nbytes for r in manifest.tensors.values() if r.placement == "shard")
    assert manifest.totals["tensor_bytes"] == saved[0]["state_bytes"]  # unique state, once
    assert shard_bytes > 0 and manifest.tensors["optim/state/0/exp_avg"].placement == "shard"
    results = ranks.run("collective.scen_fsdp:load", 3, args, tmp_path / "load").check()
    for r in results:
        assert r["equal"] and r["optimizer_state_sharded"] and r["trains"]
        # its shards, widened to whole 64-byte checksum blocks at each end of each chunk read
        assert r["need"] / 2 <= r["bytes_read"] <= r["need"] + 2 * 64 * 2 * r["tensors"], r
        assert r["bytes_read"] < saved[0]["state_bytes"] / 2
    from .scen_fsdp import model_and_optimizer

    model, opt = model_and_optimizer(None)
    ss.load({"model": model, "optim": opt}, args["path"])
    reference = load_file(args["reference"])
    assert same_bits(model.state_dict()["0.weight"], reference["model/0.weight"])
    assert same_bits(opt.state_dict()["state"][3]["exp_avg_sq"], reference["optim/3/exp_avg_sq"])

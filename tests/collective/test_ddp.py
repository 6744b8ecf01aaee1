"""DDP model + optimizer + RNG: saved once in total across 2 ranks, loaded on 1, 2 and 3 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import snapstate as ss
from support.bits import same_bits

from .common import flat_tensors
from .launch import RankServer

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def saved(ranks: RankServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("ddp")
    args = {"path": str(work / "ckpt"), "reference": str(work / "reference.safetensors")}
    results = ranks.run("collective.scen_ddp:save", 2, args, work / "save").check()
    return {"args": args, "results": results, "work": work}


def test_written_once_in_total_and_split_evenly(saved: dict[str, Any]) -> None:
    manifest = ss.inspect(saved["args"]["path"])
    results = saved["results"]
    rank_local = sum(t.nbytes for r in manifest.rank_local.values() for t in r.tensors.values())
    replicated = sum(t.nbytes for t in manifest.tensors.values())
    assert replicated == results[0]["state_bytes"]  # the unique state, not 2x
    assert manifest.totals["tensor_bytes"] == replicated + rank_local
    assert {t.placement for t in manifest.tensors.values()} == {"replicate"}
    per_rank = manifest.totals["bytes_per_rank"]
    assert per_rank == [r["bytes_written"] for r in results]
    total = sum(per_rank)
    chunk = 32 << 10
    # total/N plus at most one chunk (and a header)
    assert max(per_rank) <= total / 2 + chunk + 4096, per_rank
    assert all(len(rec.chunks) >= 1 for rec in manifest.tensors.values())
    assert any(len(rec.chunks) > 1 for rec in manifest.tensors.values())  # large tensors were split
    assert ss.verify(saved["args"]["path"]).ok


def test_loads_back_on_the_same_two_ranks(saved: dict[str, Any]) -> None:
    for r in saved["results"]:
        assert r["same_after_load"] and r["rng_restored"]
    total = sum(r["bytes_read"] for r in saved["results"])
    received = [r["bytes_received"] for r in saved["results"]]
    state = saved["results"][0]["state_bytes"]
    # read once in total (plus each rank's own RNG state), the rest received from the other rank
    assert state <= total <= state + 2 * 64 * 1024
    assert all(n > 0 for n in received)


def test_plan_is_cached_while_the_structure_is_unchanged(saved: dict[str, Any]) -> None:
    for r in saved["results"]:
        assert r["plan_cached"] == [0.0, 1.0, 0.0]  # the third save changed rank 1's structure
    third = ss.inspect(saved["args"]["path"] + "-third")
    assert "extra" in {k for k, _ in third.tree["d"]}
    assert any("extra" in key for rec in third.rank_local.values() for key in rec.tensors)


def test_loads_on_three_ranks(ranks: RankServer, saved: dict[str, Any]) -> None:
    results = ranks.run(
        "collective.scen_ddp:load", 3, saved["args"], saved["work"] / "load3"
    ).check()
    state = saved["results"][0]["state_bytes"]
    for r in results:
        assert "saved on 2 ranks, loading on 3" in r["rank_local_error"]
        assert r["read_once=True"]["equal"] and r["read_once=False"]["equal"]
        assert r["read_once=False"]["bytes_read"] == state  # every rank reads everything itself
    once = [r["read_once=True"] for r in results]
    assert sum(o["bytes_read"] for o in once) == state  # each byte range read once in the job
    assert all(o["bytes_read"] + o["bytes_received"] == state for o in once)
    assert max(o["bytes_read"] for o in once) < state / 2


def test_loads_in_one_process(saved: dict[str, Any]) -> None:
    from .scen_ddp import build, live_tensors

    reference = load_file(saved["args"]["reference"])
    with pytest.raises(ss.IncompatibleStateError, match="saved on 2 ranks"):
        ss.load({"model": build()[0], "rng": ss.RNGState()}, saved["args"]["path"])
    model, opt = build()
    state = {"model": model, "optim": opt, "step": 0}
    ss.load(state, saved["args"]["path"], rank_local="skip")
    got = live_tensors(model, opt)
    assert sorted(got) == sorted(reference)
    assert all(same_bits(got[k], reference[k]) for k in reference)
    assert state["step"] == 3
    full = flat_tensors(ss.read_state(saved["args"]["path"]))
    assert same_bits(full["model/0.weight"], reference["model/0.weight"])
    assert isinstance(full["model/0.weight"], torch.Tensor)


@pytest.fixture(scope="module")
def saved_full(ranks: RankServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("ddp-full")
    args = {"path": str(work / "ckpt"), "reference": str(work / "reference.safetensors")}
    results = ranks.run("collective.scen_ddp:save_full", 2, args, work / "save").check()
    return {"args": args, "results": results}


def test_the_model_alone_loads_on_one_process(saved_full: dict[str, Any]) -> None:
    from .scen_ddp import build

    path = saved_full["args"]["path"]
    assert ss.inspect(path).world_size == 2 and len(ss.inspect(path).rank_local) == 2
    reference = load_file(saved_full["args"]["reference"])
    model = build()[0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ss.load({"model": model}, path)  # loader, rng and optim are not asked for: ignored
    got = model.state_dict()
    assert sorted(got) == sorted(reference)
    assert all(same_bits(got[k], reference[k]) for k in reference)
    ss.load({"model": build()[0], "step": 0}, path, strict=False)


def test_per_rank_keys_asked_for_are_refused_by_name(saved_full: dict[str, Any]) -> None:
    from .scen_ddp import build

    path = saved_full["args"]["path"]
    with pytest.raises(ss.IncompatibleStateError) as info:
        ss.load({"model": build()[0], "rng": ss.RNGState()}, path)
    assert [m.key for m in info.value.mismatches] == ["rng"]
    assert "saved on 2 ranks, loading on 1" in str(info.value)
    assert "rank_local='skip'" in str(info.value)
    assert "  loader:" not in str(info.value)
    ss.load({"model": build()[0], "rng": ss.RNGState()}, path, rank_local="skip")


def test_partial_load_errors_are_the_real_ones(saved_full: dict[str, Any]) -> None:
    from torch import nn

    path = saved_full["args"]["path"]
    for target in ({}, {"other": 1}):
        with pytest.raises(ss.IncompatibleStateError, match="matches no key"):
            ss.load(target, path)
        with pytest.raises(ss.IncompatibleStateError, match="matches no key"):
            ss.load(target, path, strict=False)
    wrong = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 130))
    before = [p.clone() for p in wrong.parameters()]
    with pytest.raises(ss.IncompatibleStateError) as info:
        ss.load({"model": wrong}, path)
    message = str(info.value)
    assert "model/0.weight: shape [128, 64] in target, [256, 64] in checkpoint" in message
    assert "  loader:" not in message and "  rng:" not in message
    assert all(same_bits(a, b) for a, b in zip(before, wrong.parameters()))  # left as it was


def test_read_state_reads_one_ranks_part(saved_full: dict[str, Any]) -> None:
    path = saved_full["args"]["path"]
    reference = load_file(saved_full["args"]["reference"])
    model = ss.read_state(path, ["model"])
    assert sorted(model) == ["model"]
    assert all(same_bits(model["model"][k], reference[k]) for k in reference)
    one = ss.read_state(path, ["model/0.bias"])["model"]
    assert sorted(one) == ["0.bias"] and same_bits(one["0.bias"], reference["0.bias"])
    positions = [r["loader_position"] for r in saved_full["results"]]
    for rank in (0, 1):
        loader = ss.read_state(path, ["loader"], rank=rank)["loader"]
        assert loader["_num_yielded"] == positions[rank]
    everything = ss.read_state(path)  # this process is rank 0
    assert sorted(everything) == ["loader", "model", "optim", "rng", "step"]
    assert everything["loader"]["_num_yielded"] == positions[0]
    assert "loader" not in ss.read_state(path, rank=5)  # everything readable by rank 5
    with pytest.raises(ss.IncompatibleStateError, match=r"rank=5.*ranks \[0, 1\]"):
        ss.read_state(path, ["loader"], rank=5)
    with pytest.raises(ss.IncompatibleStateError, match="model/nope: missing in checkpoint"):
        ss.read_state(path, ["model/nope"])


def test_a_two_rank_training_checkpoint_exports(saved_full: dict[str, Any], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from snapstate.cli import main

    path = saved_full["args"]["path"]
    reference = load_file(saved_full["args"]["reference"])
    done = CliRunner().invoke(main, ["export", path, "--to", "torch", str(tmp_path / "s.pt")])
    assert done.exit_code == 0, done.output
    assert "left out (per-rank state" in done.stderr and "loader" in done.stderr
    state = torch.load(tmp_path / "s.pt", weights_only=True)  # no per-rank placeholders
    assert sorted(state) == ["model", "optim", "step"]
    assert all(same_bits(state["model"][k], reference[k]) for k in reference)
    assert ss.export_hf(path, tmp_path / "hf") == ["model.safetensors"]
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(reference)  # no "model/" prefix
    assert all(same_bits(exported[k], reference[k]) for k in reference)


def test_no_collective_runs_in_the_background(ranks: RankServer, tmp_path: Path) -> None:
    results = ranks.run(
        "collective.scen_ddp:background_is_collective_free",
        2,
        {"path": str(tmp_path / "a")},
        tmp_path / "job",
    ).check()
    for r in results:
        assert r["calls"] > 0 and r["threads"] == [r["main"]]
    assert all(ss.inspect(str(tmp_path / f"a-{i}")).world_size == 2 for i in range(3))


def test_process_groups(ranks: RankServer, tmp_path: Path) -> None:
    results = ranks.run(
        "collective.scen_ddp:subgroups", 4, {"path": str(tmp_path / "ckpt")}, tmp_path / "job"
    ).check()
    assert [(r["world"], r["rank"]) for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert all(r["same"] and r["received"] > 0 for r in results)
    for g in (0, 1):
        manifest = ss.inspect(str(tmp_path / f"ckpt-g{g}"))
        assert manifest.world_size == 2 and len(manifest.totals["bytes_per_rank"]) == 2

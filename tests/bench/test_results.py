"""From what every rank observed to records: slowest rank per checkpoint, overhead, bytes per rank."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from snapstate.bench.determinism import LOSSES, PARAMS, compare, compare_params
from snapstate.bench.results import records_from_run


def segment(train_s: float, blocking: list[float], save: list[float], peak: int) -> dict[str, Any]:
    return {
        "train_s": train_s,
        "step_s": [0.1, 0.1, 0.3],
        "blocking_s": blocking,
        "save_s": save,
        "extra": [],
        "peak_rss": peak,
        "start_rss": 0,
        "paths": [],
    }


def rank(
    r: int, blocking: list[float], save: list[float], files: list[dict[str, Any]]
) -> dict[str, Any]:
    base = [segment(10.0, [], [], 100), segment(10.0, [], [], 100)]
    method = {
        "segment": segment(11.0 + r, blocking, save, 150),
        "load_s": 0.5 + r,
        "files": files,
        "manifest": None,
    }
    return {
        "rank": r,
        "raw_write_s": 1.0,
        "raw_bytes": 1000,
        "baseline": base,
        "methods": {"m": method},
    }


def test_records_take_the_slowest_rank_per_checkpoint() -> None:
    files = [{"path": "a", "bytes": 300, "rank": 0}, {"path": "b", "bytes": 100, "rank": 1}]
    run = {
        "unique_state_bytes": 400,
        "model_params": 100,
        "device": "cpu",
        "ranks": [rank(0, [0.1, 0.4], [0.2, 0.5], files), rank(1, [0.3, 0.2], [0.6, 0.3], [])],
    }
    (rec,) = records_from_run(run, "model", 0, {"m": {"format": "f"}})
    assert rec.blocking_s_all == [0.3, 0.4] and rec.save_s_all == [0.6, 0.5]
    assert rec.blocking_s == pytest.approx(0.35) and rec.save_s == pytest.approx(0.55)
    assert rec.bytes_per_rank == [300, 100] and rec.bytes_on_disk == 400 and rec.files == 2
    assert rec.overhead_pct == pytest.approx(20.0)  # 12 s against 10 s
    assert rec.load_s == 1.5 and rec.rss_added_bytes == 50
    assert rec.raw_write_bytes_per_s == pytest.approx(2000.0)
    assert rec.train_step_s == pytest.approx(0.1)


def write_run(path: Path, losses: dict[int, float], params: dict[str, torch.Tensor] | None) -> None:
    path.mkdir(parents=True)
    (path / LOSSES).write_text("".join(f"{s} {v.hex()}\n" for s, v in losses.items()))
    if params is not None:
        save_file(params, str(path / PARAMS))


def test_compare_finds_the_first_divergent_step(tmp_path: Path) -> None:
    w = torch.ones(3)
    write_run(tmp_path / "ref", {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.7}, {"w": w})
    # lines after the checkpoint are ignored
    write_run(tmp_path / "killed", {1: 1.0, 2: 0.9, 3: 0.5}, None)
    write_run(tmp_path / "same", {3: 0.8, 4: 0.7}, {"w": w.clone()})
    write_run(tmp_path / "diff", {3: 0.8, 4: 0.75}, {"w": w + 0.25})
    same = compare("snapstate", "m", 1, 2, tmp_path / "ref", tmp_path / "killed", tmp_path / "same")
    assert same.deterministic and same.first_divergent_step is None and same.reason == ""
    diff = compare(
        "torch-rank0", "m", 1, 2, tmp_path / "ref", tmp_path / "killed", tmp_path / "diff"
    )
    assert not diff.deterministic and diff.first_divergent_step == 4
    assert diff.max_param_diff == 0.25 and diff.max_loss_diff == pytest.approx(0.05)
    assert "RNG" in diff.reason


def test_bitwise_means_bits(tmp_path: Path) -> None:
    save_file({"w": torch.tensor([0.0])}, str(tmp_path / "a"))
    save_file({"w": torch.tensor([-0.0])}, str(tmp_path / "b"))
    assert compare_params(tmp_path / "a", tmp_path / "b") == (False, 0.0)
    save_file({"v": torch.tensor([0.0])}, str(tmp_path / "c"))
    assert compare_params(tmp_path / "a", tmp_path / "c") == (False, math.inf)


def test_repeated_loads_take_the_slowest_rank_per_load_then_the_median() -> None:
    ranks = [rank(0, [0.1], [0.2], []), rank(1, [0.1], [0.2], [])]
    ranks[0]["methods"]["m"]["load_s_all"] = [0.9, 0.2, 0.3]
    ranks[1]["methods"]["m"]["load_s_all"] = [0.1, 0.4, 0.2]
    run = {"unique_state_bytes": 400, "model_params": 100, "device": "cpu", "ranks": ranks}
    (rec,) = records_from_run(run, "model", 0, {"m": {"format": "f"}})
    assert rec.load_s_all == [0.9, 0.4, 0.3]
    assert rec.load_s == pytest.approx(0.4)  # not the first, cold-process outlier

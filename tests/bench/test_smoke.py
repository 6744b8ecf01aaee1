"""The smoke preset end to end: real ranks, every method, the report, and what must hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from snapstate.bench.command import bench
from snapstate.bench.plots import DETERMINISM_PLOT, PLOTS
from snapstate.bench.results import validate

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("smoke")
    result = CliRunner().invoke(bench, ["--preset", "smoke", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "results.json").read_text())


def records(doc: dict[str, Any], method: str) -> list[dict[str, Any]]:
    return [r for r in doc["records"] if r["method"] == method]


def test_writes_results_report_and_plots(smoke: tuple[Path, dict[str, Any]]) -> None:
    out, doc = smoke
    assert validate(doc) == []
    assert doc["errors"] == []
    assert (out / "report.md").read_text().startswith("# snapstate bench")
    for png in (*PLOTS, DETERMINISM_PLOT):
        assert (out / png).stat().st_size > 1000, png
    assert not (out / "work").exists()  # checkpoints and job files are cleaned up


def test_every_method_ran_or_says_why(smoke: tuple[Path, dict[str, Any]]) -> None:
    _, doc = smoke
    ran = {(r["method"], r["ranks"]) for r in doc["records"]}
    skipped = {(s["method"], s["ranks"]) for s in doc["skipped"]}
    for method in doc["config"]["methods"]:
        for ranks in doc["config"]["ranks"]:
            assert (method, ranks) in ran | skipped, (method, ranks)
    assert {r["method"] for r in doc["records"]} == set(doc["config"]["methods"])


def test_blocking_never_exceeds_total_save_time(smoke: tuple[Path, dict[str, Any]]) -> None:
    _, doc = smoke
    cfg = doc["config"]
    for r in doc["records"]:
        # older ones pruned on the way
        assert r["checkpoints"] == (cfg["steps"] - 1) // cfg["every"]
        assert 0 < r["blocking_s"] <= r["save_s"], r["method"]
        for b, s in zip(r["blocking_s_all"], r["save_s_all"], strict=True):
            assert b <= s


def test_allranks_writes_one_full_copy_per_rank(smoke: tuple[Path, dict[str, Any]]) -> None:
    _, doc = smoke
    for r in records(doc, "torch-allranks"):
        assert r["bytes_on_disk"] == pytest.approx(r["ranks"] * r["unique_state_bytes"], rel=0.1)
        assert r["files"] == r["ranks"]


def test_rank0_is_a_hotspot(smoke: tuple[Path, dict[str, Any]]) -> None:
    _, doc = smoke
    for r in records(doc, "torch-rank0"):
        assert r["bytes_per_rank"][0] == r["bytes_on_disk"] and sum(r["bytes_per_rank"][1:]) == 0


@pytest.mark.parametrize("method", ["snapstate", "snapstate-async", "dcp"])
def test_deduplicating_methods_write_the_state_once(
    smoke: tuple[Path, dict[str, Any]], method: str
) -> None:
    _, doc = smoke
    assert records(doc, method)
    for r in records(doc, method):
        # Metadata (manifest, DCP's .metadata) is the only extra; on tiny models it is a few %.
        assert r["bytes_on_disk"] == pytest.approx(
            r["unique_state_bytes"], rel=0.1 if "snap" in method else 0.35
        )
        assert sum(r["bytes_per_rank"]) == r["bytes_on_disk"]


def test_snapstate_resumes_bitwise(smoke: tuple[Path, dict[str, Any]]) -> None:
    _, doc = smoke
    (check,) = [c for c in doc["determinism"] if c["method"] == "snapstate"]
    assert check["params_identical"] and check["losses_identical"], check
    assert check["max_param_diff"] == 0.0
    assert all(
        r["deterministic"] for r in records(doc, "snapstate") if r["ranks"] == check["ranks"]
    )

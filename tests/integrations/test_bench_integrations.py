"""The harness's `integrations` preset at tiny size: Lightning's TorchCheckpointIO and
AsyncCheckpointIO beside snapstate's plug-in and ss.async_save of the same dict, one rank,
in `.venv-integrations` (`make test-integrations`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from snapstate.bench.presets import INTEGRATION_METHODS, PRESETS, BenchConfig, DeterminismPlan
from snapstate.bench.runner import run_bench
from support.integrations import needs

MODEL = "resnet18:w=0.125"
pytestmark = [needs("lightning"), pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    cfg = BenchConfig(
        preset="integrations-smoke",
        models=(MODEL,),
        ranks=(1,),
        methods=INTEGRATION_METHODS,
        steps=5,
        every=2,
        repeats=1,
        warmup=1,
        batch=8,
        samples=128,
        determinism=DeterminismPlan(INTEGRATION_METHODS, MODEL, ranks=1, steps=6, every=3),
        timeout_s=600.0,
    )
    out = tmp_path_factory.mktemp("integrations")
    return out, run_bench(cfg, out)


def test_the_preset_runs_every_integration_method() -> None:
    assert PRESETS["integrations"].methods == INTEGRATION_METHODS


def test_every_method_measured(run: tuple[Path, dict[str, Any]]) -> None:
    _, doc = run
    assert doc["errors"] == [] and doc["skipped"] == []
    for method in INTEGRATION_METHODS:
        (rec,) = [r for r in doc["records"] if r["method"] == method]
        assert rec["checkpoints"] == 2 and rec["blocking_s"] > 0 and rec["load_s"] > 0
        assert rec["save_s"] >= rec["blocking_s"]
        assert rec["bytes_on_disk"] >= rec["unique_state_bytes"] * 0.9, rec
        timings = rec["extra"]["library_timings"]
        assert len(timings) == 2 and all(t["io_blocking_s"] > 0 for t in timings)


def test_the_report_has_the_glue_ratio(run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = run
    report = (out / "report.md").read_text()
    section = report[report.index("## Trainer integrations") :]
    rows = [line for line in section.splitlines() if line.startswith(f"| {MODEL} | 1 |")]
    (ratio,) = rows  # the glue ratio table: model | ranks | IO call | whole blocking
    cells = [c.strip() for c in ratio.strip("|").split("|")]
    assert all(float(c.rstrip("×")) > 0 for c in cells[2:]), ratio
    for method in INTEGRATION_METHODS:
        assert f"| {method} | {MODEL} | 1 |" in section


def test_only_the_snapstate_dicts_resume_bitwise(run: tuple[Path, dict[str, Any]]) -> None:
    _, doc = run
    by_method = {c["method"]: c for c in doc["determinism"]}
    assert set(by_method) == set(INTEGRATION_METHODS)
    for method in ("lightning-snapstate", "lightning-ss-async"):
        assert by_method[method]["deterministic"], by_method[method]
    for method in ("lightning-torch", "lightning-async"):  # no global RNG in their checkpoint
        assert not by_method[method]["losses_identical"], method
        assert by_method[method]["reason"]

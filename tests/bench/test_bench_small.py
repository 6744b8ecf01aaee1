"""Smoke test of benchmarks/bench_small.py: tiny states, the table's structure, finite ratios."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    path = ROOT / "benchmarks" / "bench_small.py"
    spec = importlib.util.spec_from_file_location("bench_small", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_small"] = module
    spec.loader.exec_module(module)
    return module


def test_model_adam_state_has_moments() -> None:
    state = load_script().model_adam_tensors("resnet18:w=0.125")
    assert any(k.startswith("model.") for k in state)
    assert any(k.endswith(".exp_avg_sq") for k in state)
    assert len(state) > 200


def test_tiny_run_prints_every_ratio(tmp_path: Path) -> None:
    script = load_script()
    out = tmp_path / "small.json"
    argv = ["--models", "resnet18:w=0.125", "--big-mib", "4", "--repeats", "2"]
    argv += ["--warmup", "1", "--dir", str(tmp_path), "--json", str(out)]
    # The exit code reflects timing targets; a smoke test checks structure, not speed.
    assert script.main(argv) in (0, 1)
    doc = json.loads(out.read_text())
    assert set(doc["medians_s"]) == {"resnet18:w=0.125+adam", "4 MiB x16"}
    small = [r for r in doc["rows"] if r["state"] == "resnet18:w=0.125+adam"]
    big = [r for r in doc["rows"] if r["state"] == "4 MiB x16"]
    assert [(r["numerator"], r["denominator"]) for r in small] == [(a, b) for a, b in script.RATIOS]
    assert [(r["numerator"], r["denominator"]) for r in big] == script.BIG_ROWS
    # a model without its own targets gets the stall and load limits, the big state its own
    assert {(r["numerator"], r["denominator"]): r["limit"] for r in small if r["limit"]} == (
        script.LIMITS["model"]
    )
    assert {(r["numerator"], r["denominator"]): r["limit"] for r in big if r["limit"]} == (
        script.LIMITS["big"]
    )
    for row in doc["rows"]:
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert math.isfinite(row["paired"]) and row["paired"] > 0
        expected = (
            "-" if row["limit"] is None else ("PASS" if row["ratio"] <= row["limit"] else "FAIL")
        )
        assert row["result"] == expected
    assert not list(tmp_path.glob("snapstate-small-*")), "the benchmark left its files behind"

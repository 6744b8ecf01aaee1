"""The harness on TensorFlow and Chainer: native methods beside snapstate's, 1 and 2 ranks.

Runs in the framework's own environment (``make test-frameworks``): real ranks (TF_CONFIG
workers for TensorFlow, mpirun for Chainer), the report, and the kill-and-resume check.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from snapstate.bench.presets import CHAINER_METHODS, TF_METHODS, BenchConfig, DeterminismPlan
from snapstate.bench.runner import run_bench

MODEL = "resnet18:w=0.125"
CASES = {
    "tensorflow": (TF_METHODS, ("tf-checkpoint", "snapstate-tf-async")),
    "chainer": (CHAINER_METHODS, ("chainermn-checkpointer", "snapstate-chainer-async")),
}
pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]


def _present(name: str) -> Any:
    return pytest.param(
        name,
        marks=pytest.mark.skipif(
            importlib.util.find_spec(name) is None, reason=f"needs {name}: make test-frameworks"
        ),
    )


@pytest.fixture(scope="module", params=[_present(n) for n in CASES])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    framework = request.param
    methods, checked = CASES[framework]
    cfg = BenchConfig(
        preset=f"{framework}-smoke",
        models=(MODEL,),
        ranks=(1, 2),
        methods=methods,
        steps=5,
        every=2,
        repeats=1,
        warmup=1,
        batch=8,
        samples=128,
        determinism=DeterminismPlan(checked, MODEL, ranks=2, steps=6, every=3),
        timeout_s=600.0,
    )
    out = tmp_path_factory.mktemp(framework)
    doc = run_bench(cfg, out)
    return framework, out, doc


def _records(doc: dict[str, Any], method: str, ranks: int) -> list[dict[str, Any]]:
    return [r for r in doc["records"] if r["method"] == method and r["ranks"] == ranks]


def test_every_method_measured_on_one_and_two_ranks(run: Any) -> None:
    framework, out, doc = run
    assert doc["errors"] == [] and doc["skipped"] == []
    for method in CASES[framework][0]:
        for ranks in (1, 2):
            (rec,) = _records(doc, method, ranks)
            assert rec["framework"] == framework
            assert rec["blocking_s"] > 0 and rec["load_s"] > 0
            assert rec["bytes_on_disk"] >= rec["unique_state_bytes"] * 0.9, rec
    report = (out / "report.md").read_text()
    assert all(m in report for m in CASES[framework][0])
    assert json.loads((out / "results.json").read_text())["records"]


def test_snapstate_writes_the_state_once_in_halves(run: Any) -> None:
    framework, _, doc = run
    name = f"snapstate-{'tf' if framework == 'tensorflow' else framework}"
    (rec,) = _records(doc, name, 2)
    assert rec["bytes_on_disk"] == pytest.approx(rec["unique_state_bytes"], rel=0.15)
    share = [b / rec["bytes_on_disk"] for b in rec["bytes_per_rank"]]
    assert all(0.3 < s < 0.7 for s in share), share


def test_native_writers(run: Any) -> None:
    framework, _, doc = run
    if framework == "chainer":
        # ChainerMN's checkpointer: a full copy per rank, so bytes grow with the ranks
        one, two = (_records(doc, "chainermn-checkpointer", n)[0] for n in (1, 2))
        assert two["bytes_on_disk"] == pytest.approx(2 * one["bytes_on_disk"], rel=0.05)
        assert two["files"] == 2
    # the chief (rank 0) writes every byte of the native single-writer checkpoints
    single = "tf-checkpoint" if framework == "tensorflow" else "chainer-snapshot"
    (rec,) = _records(doc, single, 2)
    assert rec["bytes_per_rank"][0] == rec["bytes_on_disk"]


def test_only_snapstate_resumes_bitwise(run: Any) -> None:
    framework, _, doc = run
    native, ours = CASES[framework][1]
    by_method = {c["method"]: c for c in doc["determinism"]}
    assert by_method[ours]["params_identical"] and by_method[ours]["losses_identical"]
    # the native recipe restores the model but not the RNG stream (and for TF the data order)
    assert not by_method[native]["losses_identical"]
    assert by_method[native]["reason"]

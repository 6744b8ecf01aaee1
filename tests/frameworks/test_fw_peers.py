"""The harness on the fastest peers: torchsnapshot and DLRover's flash checkpoint beside
snapstate, 1 and 2 ranks, in their own environment (``make venv-peers``, ``make
test-frameworks``)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from snapstate.bench.presets import PEER_METHODS, BenchConfig, DeterminismPlan
from snapstate.bench.runner import run_bench

MODEL = "resnet18:w=0.125"
METHODS = (*PEER_METHODS, "snapstate-async")
pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        importlib.util.find_spec("torchsnapshot") is None
        or importlib.util.find_spec("dlrover") is None,
        reason="needs torchsnapshot and dlrover: make test-frameworks",
    ),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = BenchConfig(
        preset="peers-smoke",
        models=(MODEL,),
        ranks=(1, 2),
        methods=METHODS,
        steps=5,
        every=2,
        repeats=1,
        warmup=1,
        batch=8,
        samples=128,
        determinism=DeterminismPlan(METHODS, MODEL, ranks=2, steps=6, every=3),
        timeout_s=900.0,
    )
    out = tmp_path_factory.mktemp("peers")
    return out, run_bench(cfg, out)


def _record(doc: dict[str, Any], method: str, ranks: int) -> dict[str, Any]:
    (rec,) = [r for r in doc["records"] if r["method"] == method and r["ranks"] == ranks]
    return rec


def test_every_peer_measured_on_one_and_two_ranks(run: Any) -> None:
    _, doc = run
    assert doc["errors"] == [] and doc["skipped"] == []
    for method in METHODS:
        for ranks in (1, 2):
            rec = _record(doc, method, ranks)
            assert rec["blocking_s"] > 0 and rec["load_s"] > 0
            assert rec["bytes_on_disk"] >= rec["unique_state_bytes"] * 0.9, rec


def test_the_report_says_which_methods_fsync(run: Any) -> None:
    out, _ = run
    fsynced = {}  # the methods table: method | format | saves | async | fsynced | who writes
    for line in (out / "report.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in METHODS:
            fsynced[cells[0]] = cells[4]
    assert fsynced == {**dict.fromkeys(PEER_METHODS, "no"), "snapstate-async": "yes"}


def test_dlrover_writes_from_rank_0_only(run: Any) -> None:
    _, doc = run
    rec = _record(doc, "dlrover-flash", 2)
    assert rec["bytes_per_rank"][0] == rec["bytes_on_disk"]


def test_only_snapstate_resumes_bitwise(run: Any) -> None:
    _, doc = run
    by_method = {c["method"]: c for c in doc["determinism"]}
    ours = by_method["snapstate-async"]
    assert ours["params_identical"] and ours["losses_identical"]
    for method in PEER_METHODS:  # their recipes restart the data order and the RNG streams
        assert not by_method[method]["losses_identical"], method
        assert by_method[method]["reason"]

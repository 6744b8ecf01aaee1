"""Merging sweeps: a framework's part rerun apart reports with the rest, later runs winning."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from snapstate.bench.command import bench
from snapstate.bench.methods import METHODS
from snapstate.bench.results import merge_results, validate

from .synthetic import document, record


def _tf_doc() -> dict[str, Any]:
    doc = copy.deepcopy(document(("torch-rank0",)))
    doc["records"] = []
    for n in (1, 2):
        rec = record("torch-rank0", "resnet18:w=0.5", n, 0)
        rec.update(method="tf-checkpoint", framework="tensorflow", blocking_s=0.123)
        doc["records"].append(rec)
    doc["methods"] = {"tf-checkpoint": METHODS["tf-checkpoint"].info.to_dict()}
    doc["config"]["methods"] = ["tf-checkpoint"]
    doc["config"]["models"] = ["resnet18:w=0.5"]
    doc["determinism"] = []
    return doc


def test_later_runs_replace_failed_ones_and_keep_the_rest() -> None:
    first = document(("torch-rank0", "snapstate-async"))
    first["errors"] = [
        {"run": "tensorflow-resnet18_w_0.5-n1-r0", "error": "boom"},
        {"run": "tensorflow-resnet18_w_0.5-n4-r0", "error": "still failing"},
    ]
    merged = merge_results([first, _tf_doc()])
    methods = {r["method"] for r in merged["records"]}
    assert methods == {"torch-rank0", "snapstate-async", "tf-checkpoint"}
    assert len(merged["records"]) == len(first["records"]) + 2
    # the 1-rank TF run now has records; the 4-rank one was not rerun, its error stays
    assert [e["run"] for e in merged["errors"]] == ["tensorflow-resnet18_w_0.5-n4-r0"]
    assert "tf-checkpoint" in merged["config"]["methods"]
    assert merged["determinism"] == first["determinism"]
    assert first["errors"][0]["run"] == "tensorflow-resnet18_w_0.5-n1-r0"  # inputs untouched


def test_same_method_model_ranks_is_replaced() -> None:
    a, b = document(("torch-rank0",)), document(("torch-rank0",))
    for r in b["records"]:
        r["blocking_s"] = 9.0
    merged = merge_results([a, b])
    assert len(merged["records"]) == len(a["records"])
    assert {r["blocking_s"] for r in merged["records"]} == {9.0}


def test_report_command_merges_into_its_own_folder(tmp_path: Path) -> None:
    one, two = tmp_path / "a" / "results.json", tmp_path / "b" / "results.json"
    for path, doc in ((one, document(("torch-rank0",))), (two, _tf_doc())):
        path.parent.mkdir()
        path.write_text(json.dumps(doc))
    result = CliRunner().invoke(bench, ["report", str(one), str(two)])
    assert result.exit_code == 0, result.output
    merged = json.loads((tmp_path / "a" / "merged" / "results.json").read_text())
    assert validate(merged) == []
    assert "tf-checkpoint" in (tmp_path / "a" / "merged" / "report.md").read_text()
    assert json.loads(one.read_text())["records"] == document(("torch-rank0",))["records"]

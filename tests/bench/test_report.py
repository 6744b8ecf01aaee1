"""Report rendering from a synthetic results.json: tables per research question and the plots."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from snapstate.bench.command import bench
from snapstate.bench.plots import DETERMINISM_PLOT, PLOTS
from snapstate.bench.report import main_table, render_markdown, render_report
from snapstate.bench.results import apply_determinism, read_results, validate

from .synthetic import document


def test_synthetic_document_follows_the_schema() -> None:
    assert validate(document()) == []


def test_validate_names_what_is_wrong() -> None:
    doc = document()
    doc["records"][0]["blocking_s"] = "fast"
    doc["records"][1]["bytes_per_rank"] = [1, 2, 3]
    del doc["records"][2]["deterministic"]
    problems = validate(doc)
    assert any("record 0: blocking_s" in p for p in problems)
    assert any("record 1: bytes_per_rank" in p for p in problems)
    assert any("record 2: deterministic" in p for p in problems)


def test_report_has_a_section_per_research_question(tmp_path: Path) -> None:
    doc = document()
    apply_determinism(doc["records"], doc["determinism"])
    path = render_report(doc, tmp_path)
    text = path.read_text()
    for title in (
        "Main table",
        "RQ1",
        "RQ2",
        "RQ3",
        "RQ4",
        "RQ5",
        "Methods",
        "How it was measured",
    ):
        assert title in text, title
    for png in (*PLOTS, DETERMINISM_PLOT):
        assert (tmp_path / png).stat().st_size > 1000, png
        assert f"]({png})" in text
    assert "did not run on 4 rank(s): not here" in text


def test_main_table_shows_medians_and_spread_over_repeats() -> None:
    table = main_table(document())
    # snapstate-async's blocking is 10, 20, 30 ms over three repeats.
    assert "20.0 ms [10.0 ms–30.0 ms]" in table
    assert "| torch-allranks | resnet18:w=0.5 | 4 |" in table
    assert "4.00×" in table  # four full copies on four ranks


def test_determinism_reasons_are_stated() -> None:
    doc = document()
    apply_determinism(doc["records"], doc["determinism"])
    text = render_markdown(doc)
    assert "data loader begins its epoch again" in text
    rank0 = [
        r
        for r in doc["records"]
        if (r["method"], r["model"], r["ranks"]) == ("torch-rank0", "resnet18:w=0.5", 2)
    ]
    assert all(r["deterministic"] is False for r in rank0)


def test_report_without_records_still_renders(tmp_path: Path) -> None:
    doc = document()
    doc["records"], doc["determinism"] = [], []
    assert "No measurement records" in render_report(doc, tmp_path).read_text()


def test_cli_rerenders_from_results_json(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps(document()))
    out = CliRunner().invoke(bench, ["report", str(results)])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "report.md").exists() and (tmp_path / PLOTS[0]).exists()
    assert read_results(results)["schema"] == "snapstate-bench/1"


def test_cli_rejects_a_file_that_is_not_results(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema": "other"}))
    out = CliRunner().invoke(bench, ["report", str(bad)])
    assert out.exit_code != 0 and "does not follow" in out.output

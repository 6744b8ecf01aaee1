"""The report's overhead and warm-blocking cells: gains beyond the noise are flagged, not shown."""

from __future__ import annotations

from typing import Any

from snapstate.bench.report import main_table, overhead_cell, warm_blocking

from .synthetic import document


def rows(*overheads: float) -> list[dict[str, Any]]:
    return [{"overhead_pct": v} for v in overheads]


def test_a_gain_beyond_the_noise_is_called_unreliable() -> None:
    cell = overhead_cell(rows(-33.0, -30.0, -35.0))
    assert cell.startswith("measurement unreliable")
    assert "-33.0 %" in cell


def test_a_small_negative_within_the_noise_is_shown_as_measured() -> None:
    assert overhead_cell(rows(-0.5, 2.0, -3.0)) == "-0.5 % [-3.0 %–+2.0 %]"
    assert overhead_cell(rows(12.0, 10.0, 14.0)) == "+12.0 % [+10.0 %–+14.0 %]"


def test_warm_blocking_leaves_out_the_first_checkpoint() -> None:
    assert warm_blocking({"blocking_s": 0.5, "blocking_s_all": [0.9, 0.02, 0.04, 0.03]}) == 0.03
    assert warm_blocking({"blocking_s": 0.5, "blocking_s_all": []}) == 0.5


def test_main_table_flags_an_impossible_gain() -> None:
    doc = document()
    for r in doc["records"]:
        if r["method"] == "torch-allranks":
            r["overhead_pct"] = -40.0 - r["repeat"]
    table = main_table(doc)
    assert "blocking after 1st" in table
    line = next(x for x in table.splitlines() if x.startswith("| torch | torch-allranks"))
    assert "measurement unreliable" in line

"""The report's trainer-integrations table: what each CheckpointIO blocks, and the glue's ratio."""

from __future__ import annotations

import statistics
from typing import Any

from snapstate.bench.report import Row, det_cell, fmt_s, group, med, overhead_cell, spread, table

PLUGIN = "lightning-snapstate"
BASELINE = "lightning-ss-async"  # ss.async_save of the very dict the plug-in is handed


def io_blocking(r: Row) -> float:
    """Median over a record's checkpoints of the IO's own call (rank 0), Lightning's dump apart."""
    return _timing(r, "io_blocking_s")


def dump_s(r: Row) -> float:
    return _timing(r, "dump_s")


def _timing(r: Row, key: str) -> float:
    values = [t[key] for t in r.get("extra", {}).get("library_timings", []) if key in t]
    return float(statistics.median(values)) if values else float("nan")


def glue_ratio(doc: dict[str, Any], model: str, ranks: int, key: Any) -> float:
    """blocking(plug-in) / blocking(ss.async_save), medians over repeats, same model and ranks."""
    groups = group(doc["records"])
    ours, base = groups.get((PLUGIN, model, ranks)), groups.get((BASELINE, model, ranks))
    if not ours or not base:
        return float("nan")
    return med(ours, key) / med(base, key)


def ratio_rows(doc: dict[str, Any]) -> list[list[str]]:
    keys = sorted({(m, n) for meth, m, n in group(doc["records"]) if meth == PLUGIN})
    rows = []
    for model, ranks in keys:
        io = glue_ratio(doc, model, ranks, io_blocking)
        whole = glue_ratio(doc, model, ranks, "blocking_s")
        rows.append([model, str(ranks), f"{io:.2f}×", f"{whole:.2f}×"])
    return rows


def section(doc: dict[str, Any], methods: tuple[str, ...]) -> str:
    """The section, or "" when the sweep ran none of ``methods``."""
    groups = [(k, rs) for k, rs in group(doc["records"]).items() if k[0] in methods]
    if not groups:
        return ""
    rows = [
        [
            method,
            model,
            str(ranks),
            spread(rs, "blocking_s", fmt_s),
            spread(rs, dump_s, fmt_s),
            spread(rs, io_blocking, fmt_s),
            spread(rs, "save_s", fmt_s),
            overhead_cell(rs),
            det_cell(doc, rs[0]),
        ]
        for (method, model, ranks), rs in sorted(groups, key=lambda kv: (kv[0][1], kv[0][2]))
    ]
    header = ["method", "model", "ranks", "blocking / ckpt", "Lightning's dump", "IO call"]
    header += ["save / ckpt", "overhead", "resume bitwise"]
    ratios = table(["model", "ranks", "IO call", "whole blocking"], ratio_rows(doc))
    text = (
        "Each CheckpointIO's `save_checkpoint` on the dict a real `lightning.Trainer` builds "
        "(`dump_checkpoint`). Blocking is the whole stop of training (slowest rank): Lightning's "
        "dump, then the IO's call until it returns; the IO call alone is rank 0's median. "
        f"`{BASELINE}` is `ss.async_save` of the same dict: the ratio "
        f"blocking({PLUGIN}) / blocking({BASELINE}) below is the cost of the plug-in's glue "
        "(the acceptance asks for at most 1.2×)."
    )
    return (
        "## Trainer integrations — Lightning's CheckpointIOs and snapstate's plug-in\n\n"
        f"{text}\n\n{table(header, rows)}\n\nGlue ratio, {PLUGIN} / {BASELINE}:\n\n{ratios}\n"
    )

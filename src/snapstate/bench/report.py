"""report.md with one table per research question, and the PNG plots, from a results document."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from snapstate.bench import plots

Row = dict[str, Any]
Key = tuple[str, str, int]


def group(records: Iterable[Row]) -> dict[Key, list[Row]]:
    """Records of the same (method, model, ranks), one per repeat; sweep order kept."""
    out: dict[Key, list[Row]] = defaultdict(list)
    for r in records:
        out[(r["method"], r["model"], r["ranks"])].append(r)
    return dict(out)


def med(rows: list[Row], key: str | Callable[[Row], float]) -> float:
    values = [key(r) if callable(key) else r[key] for r in rows]
    return float(statistics.median(values)) if values else float("nan")


def spread(rows: list[Row], key: str | Callable[[Row], float], fmt: Callable[[float], str]) -> str:
    """``median`` alone for one repeat, else ``median [min–max]``."""
    values = [key(r) if callable(key) else r[key] for r in rows]
    if not values:
        return "–"
    m = fmt(statistics.median(values))
    return m if len(values) == 1 else f"{m} [{fmt(min(values))}–{fmt(max(values))}]"


def fmt_s(x: float) -> str:
    if x != x:
        return "–"
    if abs(x) < 1:
        return f"{x * 1000:.1f} ms"
    return f"{x:.2f} s"


def fmt_pct(x: float) -> str:
    return f"{x:+.1f} %"


def warm_blocking(r: Row) -> float:
    """Median blocking over the checkpoints after the first: the first pays one-time set-up."""
    later = list(r.get("blocking_s_all") or [])[1:]
    return float(statistics.median(later)) if later else float(r["blocking_s"])


def overhead_cell(rows: list[Row]) -> str:
    """The overhead with its interval, unless it is a gain beyond the noise.

    Checkpointing cannot make training faster, so a median below minus the noise (half the
    range over repeats, at least 1 point) means the baseline itself was off: say so.
    """
    values = [float(r["overhead_pct"]) for r in rows]
    if not values:
        return "–"
    noise = max(1.0, (max(values) - min(values)) / 2)
    cell = spread(rows, "overhead_pct", fmt_pct)
    if statistics.median(values) < -noise:
        return f"measurement unreliable ({cell})"
    return cell


def fmt_bytes(x: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_x(x: float) -> str:
    return f"{x:.2f}×"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def redundancy(r: Row) -> float:
    return r["bytes_on_disk"] / r["unique_state_bytes"] if r["unique_state_bytes"] else float("nan")


def hotspot(values: list[float]) -> float:
    """max / mean over ranks: 1.0 is balanced, N means one rank of N does everything."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else float("nan")


def det_label(value: bool | None) -> str:
    return {True: "yes (bitwise)", False: "no", None: "not checked"}[value]


def det_cell(doc: dict[str, Any], row: Row) -> str:
    """The record's own verdict, else the method's check on another model or world size."""
    if row["deterministic"] is not None:
        return det_label(row["deterministic"])
    for c in doc.get("determinism", []):
        if c["method"] == row["method"]:
            verdict = "yes" if c["params_identical"] and c["losses_identical"] else "no"
            return f"{verdict} ({c['model']}, {c['ranks']} rank{'s' if c['ranks'] > 1 else ''})"
    return det_label(None)


def largest_ranks(records: list[Row]) -> int:
    return max((r["ranks"] for r in records), default=1)


def at_largest(doc: dict[str, Any]) -> list[tuple[Key, list[Row]]]:
    """Each (method, model) at the largest world size it ran on, in sweep order."""
    groups = group(doc["records"])
    top: dict[tuple[str, str], int] = {}
    for method, model, ranks in groups:
        top[(method, model)] = max(ranks, top.get((method, model), 0))
    return [(k, rs) for k, rs in groups.items() if top[(k[0], k[1])] == k[2]]


def _ranks_title(doc: dict[str, Any]) -> str:
    n = largest_ranks(doc["records"])
    return f"{n} rank{'s' if n > 1 else ''}, or the most a method ran on"


def main_table(doc: dict[str, Any]) -> str:
    """The summary: every method and model at the largest world size of the sweep."""
    rows = []
    for (method, model, ranks), rs in at_largest(doc):
        rows.append(
            [
                rs[0].get("framework", "torch"),
                method,
                model,
                str(ranks),
                spread(rs, "blocking_s", fmt_s),
                spread(rs, warm_blocking, fmt_s),
                spread(rs, "save_s", fmt_s),
                overhead_cell(rs),
                fmt_bytes(med(rs, "bytes_on_disk")),
                fmt_x(med(rs, redundancy)),
                f"{med(rs, lambda r: hotspot(r['bytes_per_rank'])):.2f}",
                spread(rs, "load_s", fmt_s),
                det_cell(doc, rs[0]),
            ]
        )
    header = [
        "framework",
        "method",
        "model",
        "ranks",
        "blocking / ckpt",
        "blocking after 1st",
        "save / ckpt",
        "overhead",
        "on disk",
        "× unique",
        "bytes hotspot",
        "load",
        "resume bitwise",
    ]
    return f"### Main table ({_ranks_title(doc)})\n\n" + table(header, rows)


def rq1(doc: dict[str, Any]) -> str:
    rows = []
    for (method, model, ranks), rs in sorted(
        group(doc["records"]).items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])
    ):
        rows.append(
            [
                model,
                method,
                str(ranks),
                spread(rs, "blocking_s", fmt_s),
                spread(rs, "persist_s", fmt_s),
                spread(rs, "save_s", fmt_s),
                f"{fmt_s(med(rs, 'train_step_s'))} / {fmt_s(med(rs, 'baseline_step_s'))}",
                overhead_cell(rs),
            ]
        )
    header = [
        "model",
        "method",
        "ranks",
        "blocking / ckpt",
        "persist (background)",
        "save total",
        "step with / without ckpt",
        "overhead",
    ]
    return _section(
        "RQ1 — overhead vs scale",
        "Blocking is the time training stops per checkpoint (slowest rank); persist is the rest of "
        "the save, done while training goes on; overhead compares the wall time of the same steps "
        "with and without checkpoints.",
        table(header, rows),
        "overhead_vs_ranks.png",
        "blocking_vs_persist.png",
    )


def rq2(doc: dict[str, Any]) -> str:
    rows = []
    for (method, model, ranks), rs in at_largest(doc):
        r = rs[0]
        rows.append(
            [
                model,
                method,
                str(ranks),
                r.get("format", ""),
                str(r["files"]),
                fmt_bytes(med(rs, "bytes_on_disk")),
                fmt_bytes(r["unique_state_bytes"]),
                fmt_x(med(rs, redundancy)),
                fmt_bytes(r.get("largest_file_bytes", 0)),
                ", ".join(fmt_bytes(b) for b in r["bytes_per_rank"]),
            ]
        )
    header = [
        "model",
        "method",
        "ranks",
        "format",
        "files",
        "on disk",
        "unique state",
        "× unique",
        "largest file",
        "bytes per rank",
    ]
    return _section(
        f"RQ2 — formats and sizes ({_ranks_title(doc)})",
        "Unique state is one copy of the model and optimizer tensors; × unique above 1 is redundancy.",
        table(header, rows) + "\n" + bytes_vs_ranks(doc),
        "bytes_on_disk.png",
        "bytes_vs_ranks.png",
    )


def bytes_vs_ranks(doc: dict[str, Any]) -> str:
    """Bytes on disk of one checkpoint at every world size: does the method write a copy per rank?"""
    worlds = sorted({r["ranks"] for r in doc["records"]})
    if len(worlds) < 2:
        return ""
    by_key = group(doc["records"])
    rows = []
    for method, model in sorted({(m, mo) for m, mo, _ in by_key}, key=lambda k: (k[1], k[0])):
        sizes = {
            n: med(by_key[method, model, n], "bytes_on_disk")
            for n in worlds
            if (method, model, n) in by_key
        }
        first, last = min(sizes), max(sizes)
        growth = sizes[last] / sizes[first] if sizes[first] else 0.0
        cells = [fmt_bytes(sizes[n]) if n in sizes else "–" for n in worlds]
        rows.append([model, method, *cells, f"{growth:.2f}× ({first}→{last} ranks)"])
    header = ["model", "method", *[f"on disk, {n} rank{'s' if n > 1 else ''}" for n in worlds]]
    text = (
        "\nBytes on disk against the number of ranks, measured: 1.00× means one copy of the state "
        "whatever the scale; growth in step with the ranks means every rank writes its own copy.\n\n"
    )
    return text + table([*header, "growth"], rows)


def rq3(doc: dict[str, Any]) -> str:
    checks = doc.get("determinism", [])
    if not checks:
        return _section(
            "RQ3 — deterministic restart", "No kill-and-resume check ran in this sweep.", ""
        )
    rows = []
    for c in checks:
        rows.append(
            [
                c["method"],
                c["model"],
                str(c["ranks"]),
                f"{c['checkpoint_step']} / {c['steps']}",
                "yes" if c["params_identical"] else "no",
                "yes" if c["losses_identical"] else "no",
                f"{c['max_param_diff']:.3g}",
                f"{c['max_loss_diff']:.3g}",
                str(c["first_divergent_step"] or "–"),
                c.get("reason", "") or "–",
            ]
        )
    header = [
        "method",
        "model",
        "ranks",
        "ckpt / steps",
        "params bitwise",
        "losses bitwise",
        "max |Δparam|",
        "max |Δloss|",
        "first divergent step",
        "why not identical",
    ]
    text = (
        "Each method trains uninterrupted, and separately is killed with SIGKILL after its "
        "checkpoint and resumed in a new process with that method's usual recipe; the final "
        "parameters and every step's loss are compared bit for bit."
    )
    return _section("RQ3 — deterministic restart", text, table(header, rows), "determinism.png")


def rq4(doc: dict[str, Any]) -> str:
    rows = []
    for (method, model, ranks), rs in sorted(
        group(doc["records"]).items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])
    ):
        write_bps, raw_bps = med(rs, "write_bytes_per_s"), med(rs, "raw_write_bytes_per_s")
        rows.append(
            [
                model,
                method,
                str(ranks),
                f"{med(rs, lambda r: hotspot(r['bytes_per_rank'])):.2f}",
                f"{med(rs, lambda r: hotspot(r.get('save_s_per_rank') or [0.0])):.2f}",
                f"{fmt_bytes(write_bps)}/s",
                f"{fmt_bytes(raw_bps)}/s",
                f"{100 * write_bps / raw_bps:.0f} %" if raw_bps else "–",
            ]
        )
    header = [
        "model",
        "method",
        "ranks",
        "bytes max/mean",
        "save time max/mean",
        "write bandwidth",
        "raw write+fsync",
        "of raw",
    ]
    return _section(
        "RQ4 — scalability limits",
        "max/mean over ranks: 1.00 is balanced, N means one rank of N does all the work (a hotspot). "
        "Raw write+fsync is plain files written by every rank at once on the same storage in the same run.",
        table(header, rows),
        "bytes_per_rank.png",
    )


def rq5(doc: dict[str, Any]) -> str:
    rows = []
    for (method, model, ranks), rs in sorted(at_largest(doc), key=lambda kv: (kv[0][1], kv[0][0])):
        r = rs[0]
        rows.append(
            [
                model,
                f"{r.get('model_params', 0) / 1e6:.2f} M",
                fmt_bytes(r["unique_state_bytes"]),
                method,
                str(ranks),
                spread(rs, "save_s", fmt_s),
                spread(rs, "load_s", fmt_s),
                fmt_bytes(med(rs, "peak_rss_bytes")),
                fmt_bytes(med(rs, "rss_added_bytes")),
            ]
        )
    header = [
        "model",
        "params",
        "state",
        "method",
        "ranks",
        "save",
        "load",
        "peak RSS",
        "RSS added by ckpt",
    ]
    return _section(
        f"RQ5 — model size and architecture ({_ranks_title(doc)})",
        "RSS added: how much more the resident memory rose while training with checkpoints "
        "than while training without them (largest rank); memory a method keeps between "
        "saves (staging pools) counts from its first save.",
        table(header, rows),
    )


def methods_section(doc: dict[str, Any]) -> str:
    rows = []
    for name, info in doc["methods"].items():
        rows.append(
            [
                name,
                info["format"],
                ", ".join(info["saves"]),
                "yes" if info["asynchronous"] else "no",
                "yes" if info.get("fsynced", True) else "no",
                info["writers"],
            ]
        )
    return _section(
        "Methods",
        "fsynced: whether a save is reported done only once its bytes are on stable storage "
        "(torchsnapshot never fsyncs; DLRover's saver does not either): a save time without "
        "fsync is not comparable with one that includes it.",
        table(["method", "format", "saves", "async", "fsynced", "who writes"], rows)
        + "\n"
        + skipped_text(doc),
    )


def skipped_text(doc: dict[str, Any]) -> str:
    """Methods that could not run on some world sizes, one line per method and reason."""
    by_reason: dict[tuple[str, str], list[int]] = defaultdict(list)
    for s in doc.get("skipped", []):
        by_reason[(s["method"], s["reason"])].append(s.get("ranks", 0))
    return "".join(
        f"\n- **{m}** did not run on {', '.join(map(str, sorted(ws)))} rank(s): {r}"
        for (m, r), ws in by_reason.items()
    )


def notes_section(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [
        f"- Every method runs in the same processes on the same clock: {cfg['steps']} steps per "
        f"segment, a checkpoint every {cfg['every']} steps (not at the last step); the baseline "
        "is the median of three segments without checkpoints (before, between and after the "
        "methods), and the method order rotates between repeats.",
        "- Times are medians over the checkpoints of a run, then median [min–max] over repeats. "
        "A save is timed from the call until its bytes are durable (every method fsyncs).",
        "- Loads read the last checkpoint after its pages were dropped from the page cache: the "
        "median of three such loads, each timed on the slowest rank.",
        "- Overhead on a small shared machine is noisy: differences of a few percent are within noise.",
    ]
    lines += [f"- {n}" for n in doc.get("notes", [])]
    lines += [
        f"- Error in run {e['run']}: {e['error'].splitlines()[0] if e['error'] else ''}"
        for e in doc.get("errors", [])
    ]
    return _section("How it was measured", "", "\n".join(lines))


def header_section(doc: dict[str, Any]) -> str:
    h, cfg = doc["host"], doc["config"]
    return (
        f"# snapstate bench — {cfg['preset']} preset\n\n"
        f"{doc['created']} on {h.get('hostname')} ({h.get('cpus')} CPUs, {h.get('device')}), "
        f"python {h.get('python')}, torch {h.get('torch')}. Models: {', '.join(cfg['models'])}; "
        f"ranks: {', '.join(map(str, cfg['ranks']))}; repeats: {cfg['repeats']}.\n"
    )


def _section(title: str, text: str, body: str, *images: str) -> str:
    pics = "".join(f"\n\n![{i}]({i})" for i in images)
    parts = [f"## {title}", text, body.strip("\n") + pics]
    return "\n\n".join(p for p in parts if p) + "\n"


def render_markdown(doc: dict[str, Any]) -> str:
    parts = [header_section(doc)]
    if doc["records"]:
        parts += [main_table(doc) + "\n", rq1(doc), rq2(doc), rq3(doc), rq4(doc), rq5(doc)]
        parts += [integrations(doc)]
    else:
        parts += ["No measurement records.\n", rq3(doc)]
    parts += [methods_section(doc), notes_section(doc)]
    return "\n".join(p for p in parts if p)


def integrations(doc: dict[str, Any]) -> str:
    """The trainer plug-ins' table and glue ratio, when the sweep ran them."""
    from snapstate.bench.integrations_report import section
    from snapstate.bench.presets import INTEGRATION_METHODS

    return section(doc, INTEGRATION_METHODS)


def render_report(doc: dict[str, Any], out: Path) -> Path:
    """Write ``out/report.md`` and the plots it links; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    plots.render_all(doc, out)
    path = out / "report.md"
    path.write_text(render_markdown(doc))
    return path

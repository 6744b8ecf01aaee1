"""The report's PNG plots, drawn with matplotlib (Agg, so no display is needed)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

Row = dict[str, Any]
PLOTS = (
    "overhead_vs_ranks.png",
    "bytes_on_disk.png",
    "bytes_per_rank.png",
    "blocking_vs_persist.png",
    "bytes_vs_ranks.png",
)
DETERMINISM_PLOT = "determinism.png"


def _by(records: list[Row], *keys: str) -> dict[tuple[Any, ...], list[Row]]:
    out: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for r in records:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def _ordered(records: list[Row], key: str) -> list[Any]:
    return list(dict.fromkeys(r[key] for r in records))


def _median(rows: list[Row], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _subplots(count: int, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list[Any]]:
    fig, axes = plt.subplots(
        1, max(count, 1), figsize=(width * max(count, 1), height), squeeze=False
    )
    return fig, list(axes[0])


def overhead_vs_ranks(records: list[Row], path: Path) -> None:
    """Overhead (%) against ranks, one line per method, one panel per model; bars span repeats."""
    models = _ordered(records, "model")
    fig, axes = _subplots(len(models))
    groups = _by(records, "method", "model", "ranks")
    for ax, model in zip(axes, models, strict=False):
        for method in _ordered(records, "method"):
            pts = sorted(
                (n, rs) for (m, mo, n), rs in groups.items() if m == method and mo == model
            )
            if not pts:
                continue
            xs = [n for n, _ in pts]
            ys = [_median(rs, "overhead_pct") for _, rs in pts]
            lo = [
                y - min(r["overhead_pct"] for r in rs) for y, (_, rs) in zip(ys, pts, strict=True)
            ]
            hi = [
                max(r["overhead_pct"] for r in rs) - y for y, (_, rs) in zip(ys, pts, strict=True)
            ]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=method)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(title=model, xlabel="ranks", ylabel="training overhead (%)")
        ax.set_xticks(sorted({r["ranks"] for r in records}))
    axes[0].legend(fontsize=8)
    _save(fig, path)


def _at_largest(records: list[Row]) -> list[Row]:
    """Each (method, model) at the largest world size it ran on."""
    top: dict[tuple[str, str], int] = {}
    for r in records:
        top[(r["method"], r["model"])] = max(r["ranks"], top.get((r["method"], r["model"]), 0))
    return [r for r in records if r["ranks"] == top[(r["method"], r["model"])]]


def _grouped_bars(ax: Any, labels: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)


def bytes_on_disk(records: list[Row], path: Path) -> None:
    """MB on disk per method and model at the largest world size, with the unique state marked."""
    rows = _at_largest(records)
    models, methods = _ordered(rows, "model"), _ordered(rows, "method")
    groups = _by(rows, "method", "model")
    series = {
        m: [
            _median(groups.get((m, mo), [{"bytes_on_disk": 0}]), "bytes_on_disk") / 1e6
            for mo in models
        ]
        for m in methods
    }
    fig, (ax,) = _subplots(1, width=max(6.0, 1.8 * len(models) + 3))
    _grouped_bars(ax, models, series)
    for j, mo in enumerate(models):
        unique = next(r["unique_state_bytes"] for r in rows if r["model"] == mo) / 1e6
        ax.hlines(
            unique,
            j - 0.45,
            j + 0.45,
            colors="black",
            linestyles="dashed",
            label="unique state" if j == 0 else None,
        )
    n = max((r["ranks"] for r in rows), default=1)
    ax.set(
        ylabel="MB on disk per checkpoint",
        title=f"bytes on disk (up to {n} rank{'s' if n > 1 else ''})",
    )
    ax.legend(fontsize=8)
    _save(fig, path)


def bytes_per_rank(records: list[Row], path: Path) -> None:
    """MB each rank wrote, per method, for each model at the largest world size."""
    rows = _at_largest(records)
    models, methods = _ordered(rows, "model"), _ordered(rows, "method")
    fig, axes = _subplots(len(models))
    groups = _by(rows, "method", "model")
    for ax, model in zip(axes, models, strict=False):
        per = {
            f"{m} ({groups[(m, model)][0]['ranks']})": groups[(m, model)][0]["bytes_per_rank"]
            for m in methods
            if (m, model) in groups
        }
        ranks = max((len(v) for v in per.values()), default=1)
        series = {
            f"rank {k}": [v[k] / 1e6 if k < len(v) else 0.0 for v in per.values()]
            for k in range(ranks)
        }
        _grouped_bars(ax, list(per), series)
        ax.set(title=model, ylabel="MB written")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    _save(fig, path)


def blocking_vs_persist(records: list[Row], path: Path) -> None:
    """Per method: time training stops (blocking) and time hidden in the background (persist)."""
    rows = _at_largest(records)
    models, methods = _ordered(rows, "model"), _ordered(rows, "method")
    fig, axes = _subplots(len(models))
    groups = _by(rows, "method", "model")
    for ax, model in zip(axes, models, strict=False):
        names = [m for m in methods if (m, model) in groups]
        block = [_median(groups[(m, model)], "blocking_s") * 1e3 for m in names]
        persist = [_median(groups[(m, model)], "persist_s") * 1e3 for m in names]
        ax.barh(names, block, color="tab:red", label="blocking (training stopped)")
        ax.barh(names, persist, left=block, color="tab:green", label="persist (background)")
        ax.set(title=model, xlabel="ms per checkpoint")
        ax.invert_yaxis()
    axes[0].legend(fontsize=8)
    _save(fig, path)


def determinism(checks: list[Row], path: Path) -> None:
    """The determinism table as a picture: green when bitwise identical, red otherwise."""
    header = ["method", "model", "ranks", "params bitwise", "losses bitwise", "max |Δparam|"]
    cells, colours = [], []
    for c in checks:
        ok = c["params_identical"] and c["losses_identical"]
        cells.append(
            [
                c["method"],
                c["model"],
                str(c["ranks"]),
                _yn(c["params_identical"]),
                _yn(c["losses_identical"]),
                f"{c['max_param_diff']:.3g}",
            ]
        )
        colours.append(["#d8f5d0" if ok else "#f8d4d4"] * len(header))
    fig, (ax,) = _subplots(1, width=8.0, height=0.45 * len(cells) + 1.0)
    ax.axis("off")
    tab = ax.table(cellText=cells, colLabels=header, cellColours=colours, loc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(9)
    tab.scale(1, 1.3)
    ax.set_title("kill (SIGKILL) and resume vs uninterrupted")
    _save(fig, path)


def _yn(flag: bool) -> str:
    return "yes" if flag else "no"


def bytes_vs_ranks(records: list[Row], path: Path) -> None:
    """MB on disk per checkpoint against ranks, one line per method, one panel per model."""
    models = _ordered(records, "model")
    fig, axes = _subplots(len(models))
    groups = _by(records, "method", "model", "ranks")
    for ax, model in zip(axes, models, strict=False):
        for method in _ordered(records, "method"):
            pts = sorted(
                (n, _median(rs, "bytes_on_disk") / 1e6)
                for (m, mo, n), rs in groups.items()
                if m == method and mo == model
            )
            if pts:
                ax.plot([n for n, _ in pts], [y for _, y in pts], marker="o", label=method)
        ax.set(title=model, xlabel="ranks", ylabel="MB on disk per checkpoint")
        ax.set_xticks(sorted({r["ranks"] for r in records}))
    axes[0].legend(fontsize=7)
    _save(fig, path)


def render_all(doc: dict[str, Any], out: Path) -> list[Path]:
    """Draw every plot the report links; returns their paths."""
    records = doc["records"]
    paths = []
    if records:
        for name, draw in zip(
            PLOTS,
            (overhead_vs_ranks, bytes_on_disk, bytes_per_rank, blocking_vs_persist, bytes_vs_ranks),
            strict=True,
        ):
            draw(records, out / name)
            paths.append(out / name)
    if doc.get("determinism"):
        determinism(doc["determinism"], out / DETERMINISM_PLOT)
        paths.append(out / DETERMINISM_PLOT)
    return paths

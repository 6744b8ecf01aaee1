"""Incremental saves (``CheckpointManager(incremental=True)``) against full saves, in one run.

(a) fine-tuning: an MLP with 90 % of its parameters frozen, AdamW on the rest; after each
    training step the same state is saved by a full manager and an incremental one
    (interleaved, blocking saves, fsync included). Reported: bytes written per save after
    the first, and save time, incremental / full. The floor of the bytes ratio is what
    changes per step: the trained parameters and AdamW's two moments of them (moments are
    state too), over the full state.
    The time floor is a plain save of only the changing tensors, timed in the same rounds:
    a save's fixed costs (flatten, plan, fsyncs, manifest, retention) are paid either way.
(b) full training: every parameter trained, so every chunk changes: incremental on / off
    save time (the digest and the comparison are the whole cost).

    .venv/bin/python benchmarks/bench_incremental.py [--width 1024] [--layers 10] [--saves 12]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import snapstate as ss


def make_model(width: int, layers: int, trained_layers: int) -> tuple[torch.nn.Module, Any]:
    """An MLP of ``layers`` square layers; only the last ``trained_layers`` are trained."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for i, layer in enumerate(model):
        layer.requires_grad_(i >= layers - trained_layers)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optim


def train_step(model: torch.nn.Module, optim: Any, width: int) -> None:
    x = torch.randn(16, width)
    loss = model(x).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def changing_share(model: torch.nn.Module, optim: Any) -> float:
    """Bytes that change per step (trained parameters and their moments) over the state's."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    moments = sum(
        t.numel() * t.element_size()
        for s in optim.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return (trained + moments) / (params + moments)


def measure(width: int, layers: int, trained_layers: int, saves: int, work: Path) -> dict[str, Any]:
    """Save after each of ``saves`` training steps with both managers, alternating which goes
    first; the first save of each (a full one for both) is left out of the medians."""
    model, optim = make_model(width, layers, trained_layers)
    state = {"model": model, "optim": optim}
    # the time floor: a full save of only what changes (the trained parameters, the optimizer)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    states = {
        "full": state,
        "incremental": state,
        "changing_only": {"model": trained, "optim": optim},
    }
    managers = {
        "full": ss.CheckpointManager(work / "full", keep_last=2, async_save=False),
        "incremental": ss.CheckpointManager(
            work / "incremental", keep_last=2, async_save=False, incremental=True
        ),
        "changing_only": ss.CheckpointManager(work / "changing", keep_last=2, async_save=False),
    }
    if trained_layers == layers:  # everything changes: the floor is the full save itself
        managers.pop("changing_only").close()
    seconds: dict[str, list[float]] = {k: [] for k in managers}
    written: dict[str, list[int]] = {k: [] for k in managers}
    try:
        for step in range(saves):
            train_step(model, optim, width)
            order = list(managers) if step % 2 == 0 else list(reversed(managers))
            for name in order:
                started = time.perf_counter()
                result = managers[name].save(step, states[name]).wait()
                elapsed = time.perf_counter() - started
                if step and result is not None:
                    seconds[name].append(elapsed)
                    written[name].append(result.bytes_written)
        share = changing_share(model, optim)
    finally:
        for m in managers.values():
            m.close()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    # the fastest save of each: on a shared machine, the one least disturbed by other load
    fastest = {k: min(v) for k, v in seconds.items()}
    byt = {k: statistics.median(v) for k, v in written.items()}
    return {
        "trained_share": trained_layers / layers,
        "state_bytes": byt["full"],
        "bytes_per_save": byt,
        "save_s": med,
        "fastest_save_s": fastest,
        "bytes_ratio": byt["incremental"] / byt["full"],
        "bytes_floor": share,
        "time_ratio": med["incremental"] / med["full"],
        "time_floor": med["changing_only"] / med["full"] if "changing_only" in med else 1.0,
        "fastest_time_ratio": fastest["incremental"] / fastest["full"],
        "saves_measured": saves - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--saves", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        work = Path(tmp)
        results = {
            "finetune": measure(args.width, args.layers, 1, args.saves, work / "a"),
            "full_training": measure(args.width, args.layers, args.layers, args.saves, work / "b"),
        }
    doc = {"width": args.width, "layers": args.layers, **results}
    text = json.dumps(doc, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    table = Table(title="incremental / full, medians (and fastest saves) of one run")
    cols = ("case", "MiB", "bytes", "floor", "time", "floor", "time (fastest)", "full s", "incr s")
    for col in cols:
        table.add_column(col)
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['state_bytes'] / 2**20:.1f}",
            f"{r['bytes_ratio']:.3f}",
            f"{r['bytes_floor']:.3f}",
            f"{r['time_ratio']:.3f}",
            f"{r['time_floor']:.3f}",
            f"{r['fastest_time_ratio']:.3f}",
            f"{r['save_s']['full']:.3f}",
            f"{r['save_s']['incremental']:.3f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()

"""Run a sweep: launch each measurement run's ranks, collect records, check determinism, report."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch

from snapstate.bench import launch
from snapstate.bench.methods import get_method
from snapstate.bench.presets import BenchConfig
from snapstate.bench.results import (
    SCHEMA,
    apply_determinism,
    records_from_run,
    tag_name,
    write_results,
)
from snapstate.bench.train import TrainConfig
from snapstate.bench.worker import MeasureJob


class Progress(Protocol):
    """Where the runner reports progress (a rich bar on a terminal, lines otherwise)."""

    def begin(self, total: int) -> None: ...

    def advance(self, label: str) -> None: ...

    def note(self, text: str) -> None: ...


class QuietProgress:
    def begin(self, total: int) -> None:
        pass

    def advance(self, label: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass


def host_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    try:
        import snapstate

        info["snapstate"] = getattr(snapstate, "__version__", "unknown")
    except ImportError:
        info["snapstate"] = None
    return info


Blocked = dict[tuple[str, int], str]


def find_blocked(names: tuple[str, ...], worlds: set[int]) -> Blocked:
    """(method, world size) pairs that cannot run here, with the reason."""
    out: Blocked = {}
    for name in names:
        for world in sorted(worlds):
            reason = get_method(name).unavailable(world)
            if reason:
                out[(name, world)] = reason
    return out


def runnable(cfg: BenchConfig, world: int, blocked: Blocked) -> list[str]:
    return [m for m in cfg.methods if (m, world) not in blocked]


def train_config(cfg: BenchConfig, model: str) -> TrainConfig:
    return TrainConfig(
        model=model, batch=cfg.batch, seed=cfg.seed, samples=cfg.samples, data_dir=cfg.data_dir
    )


def plan_runs(cfg: BenchConfig) -> list[tuple[str, int, int]]:
    """(model, ranks, repeat) of every launch, repeats outermost so drift spreads evenly.

    Each model gets fresh processes: memory a library keeps between saves (a staging pool)
    would otherwise be charged to the first model and hidden from the next.
    """
    return [(m, n, r) for r in range(cfg.repeats) for m in cfg.models for n in cfg.ranks]


def by_framework(methods: list[str]) -> dict[str, list[str]]:
    """Methods grouped by framework, in their order: each group runs in its own environment,
    against a no-checkpoint baseline of the same framework's training."""
    out: dict[str, list[str]] = {}
    for m in methods:
        out.setdefault(get_method(m).info.framework, []).append(m)
    return out


def measure_job(
    cfg: BenchConfig,
    methods: list[str],
    model: str,
    repeat: int,
    work: Path,
    tag: str,
    framework: str = "torch",
) -> MeasureJob:
    ckpt_root = Path(cfg.ckpt_dir) if cfg.ckpt_dir else work
    return MeasureJob(
        train=train_config(cfg, model),
        methods=methods,
        steps=cfg.steps,
        every=cfg.every,
        warmup=cfg.warmup,
        repeat=repeat,
        ckpt_dir=str(ckpt_root / f"ckpt-{tag}"),
        result_file=str(work / f"{tag}.json"),
        framework=framework,
    )


def run_measurements(
    jobs: list[MeasureJob], world: int, work: Path, tag: str, timeout_s: float
) -> None:
    """Launch ``world`` ranks that run the jobs (all of one framework) one after the other."""
    job_file = work / f"{tag}.job.json"
    job_file.write_text(json.dumps({"kind": "measure-batch", "jobs": [j.to_dict() for j in jobs]}))
    framework = jobs[0].framework if jobs else "torch"
    launch.run(job_file, world, work / f"logs-{tag}", timeout_s * len(jobs), framework)


def new_document(cfg: BenchConfig, blocked: Blocked) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": host_info(),
        "config": cfg.to_dict(),
        "methods": {n: get_method(n).info.to_dict() for n in cfg.methods},
        "skipped": [{"method": n, "ranks": w, "reason": r} for (n, w), r in blocked.items()],
        "records": [],
        "determinism": [],
        "errors": [],
    }


def run_bench(
    cfg: BenchConfig, out: Path, progress: Progress | None = None, keep_work: bool = False
) -> dict[str, Any]:
    """Run the whole sweep in fresh processes; write results.json, report.md and the plots."""
    progress = progress or QuietProgress()
    plan = cfg.determinism
    blocked = find_blocked(cfg.methods, set(cfg.ranks) | ({plan.ranks, 1} if plan else set()))
    doc = new_document(cfg, blocked)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    runs = [
        (model, world, repeat, fw, methods)
        for model, world, repeat in plan_runs(cfg)
        for fw, methods in by_framework(runnable(cfg, world, blocked)).items()
    ]
    det = determinism_worlds(cfg, blocked)
    progress.begin(len(runs) + determinism_launches(det))
    for (name, world), reason in blocked.items():
        progress.note(f"{name} on {world} rank(s): skipped, {reason}")
    for model, world, repeat, fw, methods in runs:
        _measure_into(doc, cfg, methods, (model, world, repeat), work, fw)
        progress.advance(f"{fw} {model} on {world} rank(s), repeat {repeat + 1}/{cfg.repeats}")
        write_results(doc, out / "results.json")  # partial results survive an interrupted sweep
    if det:
        _determinism_into(doc, cfg, det, work / "determinism", progress)
    finish(doc, out)
    if not keep_work and not doc["errors"]:
        shutil.rmtree(work, ignore_errors=True)
    return doc


def _measure_into(
    doc: dict[str, Any],
    cfg: BenchConfig,
    methods: list[str],
    run: tuple[str, int, int],
    work: Path,
    framework: str = "torch",
) -> None:
    model, world, repeat = run
    tag = f"{framework}-{tag_name(model)}-n{world}-r{repeat}"
    job = measure_job(cfg, methods, model, repeat, work, tag, framework)
    try:
        run_measurements([job], world, work, tag, cfg.timeout_s)
    except launch.WorkerError as e:
        doc["errors"].append({"run": tag, "error": str(e)[-4000:]})
    _collect(doc, job, model, repeat, tag)


def _collect(doc: dict[str, Any], job: MeasureJob, model: str, repeat: int, tag: str) -> None:
    """Records from the run's result file (absent when the run failed)."""
    try:
        raw = json.loads(Path(job.result_file).read_text())
        doc["records"] += [asdict(r) for r in records_from_run(raw, model, repeat, doc["methods"])]
    except FileNotFoundError:
        pass  # the launch's error is already recorded
    except (OSError, KeyError, ValueError) as e:
        doc["errors"].append({"run": tag, "error": str(e)[-4000:]})


def determinism_worlds(cfg: BenchConfig, blocked: Blocked) -> dict[str, int]:
    """World size of each method's kill-and-resume check: the plan's, else 1 rank if only that runs."""
    plan = cfg.determinism
    out: dict[str, int] = {}
    if plan is None:
        return out
    for m in plan.methods:
        if m not in cfg.methods:
            continue
        for world in (plan.ranks, 1):
            if (m, world) not in blocked:
                out[m] = world
                break
    return out


def determinism_launches(methods: dict[str, int]) -> int:
    from snapstate.bench.determinism import launches

    return launches(methods) if methods else 0


def _determinism_into(
    doc: dict[str, Any], cfg: BenchConfig, methods: dict[str, int], work: Path, progress: Progress
) -> None:
    from snapstate.bench.determinism import run_checks

    assert cfg.determinism is not None
    try:
        checks = run_checks(cfg, methods, work, progress, doc["errors"])
        doc["determinism"] = [c.to_dict() for c in checks]
    except (launch.WorkerError, OSError, ValueError) as e:
        doc["errors"].append({"run": "determinism", "error": str(e)[-4000:]})


def finish(doc: dict[str, Any], out: Path) -> None:
    """Fold determinism into the records, then write results.json, report.md and the plots."""
    from snapstate.bench.report import render_report

    apply_determinism(doc["records"], doc["determinism"])
    write_results(doc, out / "results.json")
    render_report(doc, out)


def run_inplace(cfg: BenchConfig, out: Path, rank: int, world: int) -> dict[str, Any] | None:
    """Under torchrun or srun: this process is one rank; run every model here, rank 0 reports."""
    from snapstate.bench.train import init_distributed, quiet_known_warnings, set_threads
    from snapstate.bench.worker import measure_on_rank

    quiet_known_warnings()
    set_threads(world)
    init_distributed(rank, world, cfg.timeout_s)
    blocked = find_blocked(cfg.methods, {world})
    # Other frameworks need their own environments and launchers: only PyTorch runs in place.
    methods = by_framework(runnable(cfg, world, blocked)).get("torch", [])
    doc = new_document(cfg, blocked)
    doc["config"]["ranks"] = [world]
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    for repeat in range(cfg.repeats):
        for model in cfg.models:
            job = measure_job(
                cfg, methods, model, repeat, work, f"{tag_name(model)}-n{world}-r{repeat}"
            )
            raw = measure_on_rank(job, rank, world)
            if raw is not None:
                doc["records"] += [
                    asdict(r) for r in records_from_run(raw, model, repeat, doc["methods"])
                ]
    if rank != 0:
        return None
    shutil.rmtree(work, ignore_errors=True)
    doc["notes"] = [
        "determinism was not checked: under torchrun/srun the harness cannot kill and relaunch its ranks",
        "all models ran in the same processes: memory a method keeps between saves counts for the first model only",
    ]
    finish(doc, out)
    return doc

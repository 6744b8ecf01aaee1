"""RQ3: train uninterrupted vs killed (SIGKILL) after a checkpoint and resumed in a new process.

Per framework and world size: one reference run, one run that checkpoints with every method
checked and is killed once all of those checkpoints are durable, then one resume per method,
each in a new group of processes. Sharing the killed run saves a launch per method (the demo
must stay within minutes); every resume still starts from its own method's files alone.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from snapstate.bench import launch
from snapstate.bench.methods import get_method
from snapstate.bench.presets import BenchConfig
from snapstate.bench.results import DeterminismResult

LOSSES = "losses.txt"
PARAMS = "params.safetensors"
MARKER = "checkpointed"
KILL_WAIT_S = 600.0


@dataclass
class TrainJob:
    """One training process group: reference (no methods), to-be-killed (each method checkpoints
    into ``ckpt_dir/<method>``), or resumed (one method, from ``resume_from``)."""

    train: dict[str, Any]
    steps: int
    out_dir: str
    methods: list[str] = field(default_factory=list)
    every: int = 0
    ckpt_dir: str = ""
    kill_after: int | None = None
    resume_from: str | None = None
    kind: str = "train"
    framework: str = "torch"


# ---- rank side -------------------------------------------------------------------------------


def train_on_rank(raw: dict[str, Any], rank: int, world: int) -> None:
    """Train to ``steps``; log rank 0's loss each step; checkpoint, or resume, as the job says."""
    from snapstate.bench.frameworks import build_trainer
    from snapstate.bench.train import TrainConfig

    job = TrainJob(**raw)
    trainer = build_trainer(job.framework, TrainConfig(**job.train), rank, world)
    methods = {name: get_method(name)(rank, world) for name in job.methods}
    for method in methods.values():
        method.prepare(trainer)
    if job.resume_from:
        (method,) = methods.values()
        method.load(trainer, Path(job.resume_from))
    out = Path(job.out_dir)
    log = open(out / LOSSES, "a") if rank == 0 else None
    while trainer.step < job.steps:
        loss = trainer.train_step()
        if log is not None:
            log.write(f"{trainer.step} {loss.hex()}\n")
            log.flush()  # lines up to the kill must survive it
        if methods and job.every and not job.resume_from and trainer.step % job.every == 0:
            checkpoint(methods, trainer, job, out)
    if job.kill_after is not None:
        time.sleep(KILL_WAIT_S)  # the parent kills this process; finishing normally is a failure
        raise SystemExit("expected to be killed")
    for method in methods.values():
        method.close()
    if rank == 0:
        _save_params(trainer, out / PARAMS)


def checkpoint(methods: dict[str, Any], trainer: Any, job: TrainJob, out: Path) -> None:
    """Save with each method; at the kill step wait until all are durable, then tell the parent
    (which kills us). One method's save finishes before the next starts: none races another."""
    import torch.distributed as dist

    for name, method in methods.items():
        method.save(trainer, checkpoint_path(Path(job.ckpt_dir), name, trainer.step))
        method.wait()
    if trainer.step != job.kill_after:
        return
    if dist.is_initialized():
        dist.barrier()
    if trainer.rank == 0:
        (out / MARKER).write_text(str(trainer.step))


def checkpoint_path(root: Path, method: str, step: int) -> Path:
    return root / method / f"step-{step:09d}"


def _save_params(trainer: Any, path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in trainer.final_params().items()}, str(path))


# ---- parent side -----------------------------------------------------------------------------


def run_checks(
    cfg: BenchConfig,
    methods: dict[str, int],
    work: Path,
    progress: Any,
    errors: list[dict[str, str]],
) -> list[DeterminismResult]:
    """Per framework and world size: a reference, one killed run for all its methods, then a
    resume per method. A run that fails goes to ``errors`` (a failed killed run takes its
    group's checks with it) and the other checks still run."""
    plan = cfg.determinism
    assert plan is not None
    train = {
        "model": plan.model,
        "batch": cfg.batch,
        "seed": cfg.seed,
        "samples": cfg.samples,
        "data_dir": cfg.data_dir,
    }
    results = []
    for (fw, world), names in check_groups(methods).items():
        group = work / f"{fw}-n{world}"
        try:
            _run(
                TrainJob(train, plan.steps, str(group / "reference"), framework=fw),
                world,
                cfg.timeout_s,
            )
            progress.advance(f"determinism: {fw} reference run of {plan.model} on {world} rank(s)")
            killed = killed_job(cfg, names, train, group, fw)
            _run_and_kill(killed, world, cfg.timeout_s)
            progress.advance(
                f"determinism: {fw} run killed after checkpoints by {len(names)} method(s)"
            )
        except (launch.WorkerError, OSError) as e:
            errors.append({"run": f"determinism-{fw}-n{world}", "error": str(e)[-4000:]})
            continue
        for name in names:
            try:
                results.append(resume_and_compare(cfg, name, world, train, group))
            except (launch.WorkerError, OSError, ValueError) as e:
                errors.append({"run": f"determinism-{name}-n{world}", "error": str(e)[-4000:]})
            progress.advance(f"determinism: {name} resumed")
    return results


def check_groups(methods: dict[str, int]) -> dict[tuple[str, int], list[str]]:
    """Methods by (framework, world size): each group shares a reference and a killed run."""
    out: dict[tuple[str, int], list[str]] = {}
    for name, world in methods.items():
        out.setdefault((get_method(name).info.framework, world), []).append(name)
    return out


def launches(methods: dict[str, int]) -> int:
    """Progress steps of the checks: a reference and a killed run per group, a resume per method."""
    return 2 * len(check_groups(methods)) + len(methods)


def killed_job(
    cfg: BenchConfig, names: list[str], train: dict[str, Any], group: Path, fw: str
) -> TrainJob:
    plan = cfg.determinism
    assert plan is not None
    return TrainJob(
        train,
        plan.steps,
        str(group / "killed"),
        list(names),
        plan.every,
        str(group / "ckpt"),
        kill_after=plan.every,
        framework=fw,
    )


def resume_and_compare(
    cfg: BenchConfig, name: str, world: int, train: dict[str, Any], group: Path
) -> DeterminismResult:
    """Resume ``name`` from its own checkpoint in new processes; compare with the reference."""
    plan = cfg.determinism
    assert plan is not None
    fw = get_method(name).info.framework
    resumed = group / f"resumed-{name}"
    resume_from = checkpoint_path(group / "ckpt", name, plan.every)
    job = TrainJob(
        train, plan.steps, str(resumed), [name], resume_from=str(resume_from), framework=fw
    )
    _run(job, world, cfg.timeout_s)
    return compare(
        name, plan.model, world, plan.every, group / "reference", group / "killed", resumed
    )


def _write_job(job: TrainJob) -> Path:
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "job.json"
    path.write_text(json.dumps(asdict(job)))
    return path


def _run(job: TrainJob, world: int, timeout_s: float) -> None:
    path = _write_job(job)
    launch.run(path, world, path.parent / "logs", timeout_s, job.framework)


def _run_and_kill(job: TrainJob, world: int, timeout_s: float) -> None:
    """Start the ranks; SIGKILL every one of them as soon as the checkpoint is durable."""
    path = _write_job(job)
    marker = path.parent / MARKER

    def start_and_kill() -> None:
        group = launch.start(path, world, path.parent / "logs", job.framework)
        try:
            launch.wait(group, timeout_s, until=marker.exists)
        finally:
            group.kill()

    launch.retry_port_race(start_and_kill)
    if not marker.exists():
        raise launch.WorkerError(
            f"{', '.join(job.methods)}: ranks ended before the checkpoints at step {job.kill_after}"
        )


def read_losses(path: Path) -> dict[int, float]:
    out = {}
    for line in (path / LOSSES).read_text().splitlines():
        step, value = line.split()
        out[int(step)] = float.fromhex(value)
    return out


def compare(
    name: str, model: str, ranks: int, at: int, ref: Path, killed: Path, resumed: Path
) -> DeterminismResult:
    """Bitwise comparison of the loss sequence and the final parameters."""
    want = read_losses(ref)
    before, after = read_losses(killed), read_losses(resumed)
    got = {s: v for s, v in before.items() if s <= at} | after
    diffs = [abs(got[s] - want[s]) if s in got else math.inf for s in sorted(want)]
    divergent = [s for s in sorted(want) if s not in got or got[s] != want[s]]
    same_params, param_diff = compare_params(ref / PARAMS, resumed / PARAMS)
    identical = not divergent and same_params
    return DeterminismResult(
        method=name,
        model=model,
        ranks=ranks,
        steps=max(want),
        checkpoint_step=at,
        killed_at_step=max(before) if before else None,
        params_identical=same_params,
        losses_identical=not divergent,
        max_param_diff=param_diff,
        max_loss_diff=max(diffs, default=0.0),
        first_divergent_step=divergent[0] if divergent else None,
        reason="" if identical else get_method(name).info.resume_note,
    )


def compare_params(a: Path, b: Path) -> tuple[bool, float]:
    """(bitwise identical, largest absolute difference) over every tensor of the model."""
    from safetensors.numpy import load_file

    x, y = load_file(str(a)), load_file(str(b))
    if x.keys() != y.keys():
        return False, math.inf
    same, worst = True, 0.0
    for k, t in x.items():
        u = y[k]
        if t.shape != u.shape or t.dtype != u.dtype:
            return False, math.inf
        if not _bitwise(t, u):
            same = False
            worst = max(worst, float(np.max(np.abs(t.astype(np.float64) - u.astype(np.float64)))))
    return same, worst


def _bitwise(t: np.ndarray, u: np.ndarray) -> bool:
    """Equal bit patterns (so -0.0 vs 0.0 or differing NaNs count as different)."""
    return t.tobytes() == u.tobytes()

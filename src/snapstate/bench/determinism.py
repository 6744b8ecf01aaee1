"""RQ3: train uninterrupted vs killed (SIGKILL) after a checkpoint and resumed in a new process."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
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
    """One training process group: reference, to-be-killed, or resumed."""

    train: dict[str, Any]
    steps: int
    out_dir: str
    method: str | None = None
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
    method = get_method(job.method)(rank, world) if job.method else None
    if method is not None and job.resume_from:
        method.load(trainer, Path(job.resume_from))
    out = Path(job.out_dir)
    log = open(out / LOSSES, "a") if rank == 0 else None
    while trainer.step < job.steps:
        loss = trainer.train_step()
        if log is not None:
            log.write(f"{trainer.step} {loss.hex()}\n")
            log.flush()  # lines up to the kill must survive it
        if (
            method is not None
            and job.every
            and not job.resume_from
            and trainer.step % job.every == 0
        ):
            checkpoint(method, trainer, job, out)
    if job.kill_after is not None:
        time.sleep(KILL_WAIT_S)  # the parent kills this process; finishing normally is a failure
        raise SystemExit("expected to be killed")
    if method is not None:
        method.close()
    if rank == 0:
        _save_params(trainer, out / PARAMS)


def checkpoint(method: Any, trainer: Any, job: TrainJob, out: Path) -> None:
    """Save; at the kill step wait until it is durable, then tell the parent (which kills us)."""
    import torch.distributed as dist

    method.save(trainer, Path(job.ckpt_dir) / f"step-{trainer.step:09d}")
    if trainer.step != job.kill_after:
        return
    method.wait()
    if dist.is_initialized():
        dist.barrier()
    if trainer.rank == 0:
        (out / MARKER).write_text(str(trainer.step))


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
    """An uninterrupted reference per world size, then a kill-and-resume check per method.

    A check that fails goes to ``errors`` and the others still run.
    """
    plan = cfg.determinism
    assert plan is not None
    train = {
        "model": plan.model,
        "batch": cfg.batch,
        "seed": cfg.seed,
        "samples": cfg.samples,
        "data_dir": cfg.data_dir,
    }
    refs: dict[tuple[str, int], Path] = {}
    results = []
    for name, world in methods.items():
        fw = get_method(name).info.framework
        if (fw, world) not in refs:
            refs[fw, world] = work / f"reference-{fw}-n{world}"
            job = TrainJob(train, plan.steps, str(refs[fw, world]), framework=fw)
            _run(job, world, cfg.timeout_s)
            progress.advance(f"determinism: {fw} reference run of {plan.model} on {world} rank(s)")
        results.append(
            check_method(cfg, name, world, train, refs[fw, world], work / f"{name}-n{world}")
        )
        progress.advance(f"determinism: {name} killed and resumed")
    return results


def check_method(
    cfg: BenchConfig, name: str, world: int, train: dict[str, Any], ref: Path, work: Path
) -> DeterminismResult:
    plan = cfg.determinism
    assert plan is not None
    ckpt = work / "ckpt"
    killed, resumed = work / "killed", work / "resumed"
    fw = get_method(name).info.framework
    job = TrainJob(
        train,
        plan.steps,
        str(killed),
        name,
        plan.every,
        str(ckpt),
        kill_after=plan.every,
        framework=fw,
    )
    _run_and_kill(job, world, cfg.timeout_s)
    resume_from = ckpt / f"step-{plan.every:09d}"
    resume = TrainJob(
        train, plan.steps, str(resumed), name, resume_from=str(resume_from), framework=fw
    )
    _run(resume, world, cfg.timeout_s)
    return compare(name, plan.model, world, plan.every, ref, killed, resumed)


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
            f"{job.method}: ranks ended before the checkpoint at step {job.kill_after}"
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

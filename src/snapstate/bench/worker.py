"""One rank of a measurement run: baseline training, then each method's checkpoints, timed alike."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from snapstate.bench.frameworks import build_trainer
from snapstate.bench.measure import PeakRSS, now, walk_files, write_fsync_seconds
from snapstate.bench.methods import BenchTrainer, Method, Pending, get_method
from snapstate.bench.train import TrainConfig, init_distributed, quiet_known_warnings, set_threads


@dataclass
class MeasureJob:
    """A measurement run: one model on one world size, every method in turn."""

    train: TrainConfig
    methods: list[str]
    steps: int
    every: int
    warmup: int
    repeat: int
    ckpt_dir: str
    result_file: str
    kind: str = "measure"
    framework: str = "torch"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Segment:
    """What one rank saw while training ``steps`` steps (with a method's checkpoints, or none)."""

    train_s: float
    step_s: list[float]
    blocking_s: list[float] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    extra: list[dict[str, Any]] = field(default_factory=list)
    peak_rss: int = 0
    start_rss: int = 0
    paths: list[str] = field(default_factory=list)


KEEP_CHECKPOINTS = 2


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rotate(items: list[str], by: int) -> list[str]:
    """Vary the order of methods between repeats so no method always runs on a warm machine."""
    if not items:
        return items
    k = by % len(items)
    return items[k:] + items[:k]


def run_segment(
    trainer: BenchTrainer, job: MeasureJob, method: Method | None, root: Path
) -> Segment:
    """Train ``job.steps`` steps; checkpoint every ``job.every`` steps strictly before the last."""
    settle_writeback()
    barrier()
    saves: list[tuple[Pending, float]] = []
    steps, paths, off_clock = [], [], 0.0
    with PeakRSS() as rss:
        start = now()
        for i in range(1, job.steps + 1):
            t = now()
            trainer.train_step()
            steps.append(now() - t)
            if method is not None and i % job.every == 0 and i < job.steps:
                paths.append(str(root / f"step-{trainer.step:09d}"))
                saves.append(timed_save(method, trainer, Path(paths[-1])))
                off_clock += prune(paths, KEEP_CHECKPOINTS, trainer.rank)
        train_s = now() - start - off_clock
        # The last persist finishes off the clock: the segment ends with the last step.
        if method is not None:
            method.wait()
    barrier()
    seg = Segment(train_s, steps, peak_rss=rss.peak, start_rss=rss.start_rss, paths=paths)
    for p, blocking in saves:
        seg.blocking_s.append(blocking)
        seg.save_s.append(max(p.save_s, blocking))
        seg.extra.append(p.extra)
    return seg


def settle_writeback() -> None:
    """Flush every dirty page before a segment starts, off the clock: a method that does not
    fsync (torch.save, Lightning's IOs) leaves its bytes to the kernel's writeback, which would
    otherwise run during, and be charged to, the next method's saves."""
    os.sync()


def timed_save(method: Method, trainer: BenchTrainer, path: Path) -> tuple[Pending, float]:
    """Start a save; (its pending completion, how long training was blocked)."""
    t = now()
    pending = method.save(trainer, path)
    return pending, now() - t


def prune(paths: list[str], keep: int, rank: int) -> float:
    """Delete all but the newest ``keep`` checkpoints (off the clock); returns the time it took.

    A method's save waits for its previous one, so every checkpoint but the newest is
    complete: deleting older ones keeps big sweeps within the disk.
    """
    old = [p for p in paths[:-keep] if Path(p).exists()] if rank == 0 else []
    if len(paths) <= keep:
        return 0.0
    start = now()
    barrier()
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    barrier()
    return now() - start


def evict_from_cache(path: Path) -> None:
    """Drop a checkpoint's pages from the page cache so the load reads the storage."""
    for rel, _size in walk_files(path):
        fd = os.open(path / rel, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# A cold load of a small state takes tens of milliseconds and the disk's latency varies by
# as much: one load per record made the load column swing by 1.5x between runs, and with
# three the two-rank loads of one method still spread over 33-86 ms (each load costs the
# demo about 0.1 s per method and record).
LOAD_REPEATS = 5


def time_load(trainer: BenchTrainer, method: Method, path: Path) -> float:
    barrier()
    if hasattr(os, "posix_fadvise"):
        evict_from_cache(path)
    barrier()
    start = now()
    method.load(trainer, path)
    elapsed = now() - start
    barrier()
    return elapsed


def files_by_rank(method: Method, path: Path) -> list[dict[str, Any]]:
    """Every file of the checkpoint with its size and the rank that wrote it."""
    return [
        {"path": rel, "bytes": size, "rank": method.owner(rel)} for rel, size in walk_files(path)
    ]


def measure_method(trainer: BenchTrainer, job: MeasureJob, name: str, root: Path) -> dict[str, Any]:
    method = get_method(name)(trainer.rank, trainer.world)
    try:
        method.prepare(trainer)
        seg = run_segment(trainer, job, method, root)
        last = Path(seg.paths[-1])
        loads = [time_load(trainer, method, last) for _ in range(LOAD_REPEATS)]
        out: dict[str, Any] = {"segment": asdict(seg), "load_s_all": loads}
        out["files"] = files_by_rank(method, last) if trainer.rank == 0 else []
        out["manifest"] = (
            manifest_totals(last) if trainer.rank == 0 and name.startswith("snapstate") else None
        )
    finally:
        method.close()
    barrier()
    if trainer.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    barrier()
    return out


def manifest_totals(path: Path) -> dict[str, Any] | None:
    """The totals snapstate records in its manifest, to cross-check the directory walk."""
    try:
        import snapstate as ss

        totals = getattr(ss.inspect(str(path)), "totals", None)
    except Exception as e:  # a report field, not a reason to lose the run
        return {"error": repr(e)}
    if totals is None or isinstance(totals, dict):
        return totals
    return asdict(totals) if hasattr(totals, "__dataclass_fields__") else {"repr": repr(totals)}


def raw_write_s(trainer: BenchTrainer, root: Path, nbytes: int) -> float:
    """Every rank writes and fsyncs ``nbytes`` at once; the slowest rank's time."""
    root.mkdir(parents=True, exist_ok=True)
    barrier()
    elapsed = write_fsync_seconds(root / f"raw-{trainer.rank}.bin", nbytes)
    barrier()
    return elapsed


def measure_on_rank(job: MeasureJob, rank: int, world: int) -> dict[str, Any] | None:
    """Run the whole measurement on this rank; rank 0 returns every rank's observations."""
    trainer = build_trainer(job.framework, job.train, rank, world)
    for _ in range(job.warmup):
        trainer.train_step()
    unique = trainer.unique_state_bytes()
    ckpt = Path(job.ckpt_dir)
    raw_bytes = max(unique // world, 4 << 20)
    mine: dict[str, Any] = {
        "rank": rank,
        "raw_write_s": raw_write_s(trainer, ckpt, raw_bytes),
        "raw_bytes": raw_bytes,
    }
    mine["baseline"], mine["methods"] = [], {}
    order = rotate(job.methods, job.repeat)
    # Baselines before, between and after the methods: their median shrugs off one bad one.
    # Each method is compared with the two baselines around it (``bracket``), which cancels
    # slow drift of the machine over the run (other load, thermal, page cache).
    for i, part in enumerate((order[: len(order) // 2], order[len(order) // 2 :], [])):
        mine["baseline"].append(asdict(run_segment(trainer, job, None, ckpt)))
        for n in part:
            mine["methods"][n] = {
                **measure_method(trainer, job, n, ckpt / n),
                "bracket": [i, i + 1],
            }
    gathered: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank != 0:
        return None
    return {
        "unique_state_bytes": unique,
        "model_params": trainer.param_count(),
        "ranks": gathered,
        "device": str(getattr(trainer, "device", "cpu")),
        "threads": _threads(),
        "framework": job.framework,
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def load_job(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def run_job(job: MeasureJob, rank: int, world: int) -> None:
    """One model's measurement; rank 0 writes the result file."""
    result = measure_on_rank(job, rank, world)
    if result is not None:
        Path(job.result_file).write_text(json.dumps(result))
    gc.collect()  # the next model starts from a clean heap


def rank_from_env() -> tuple[int, int]:
    """(rank, world) from the launcher: ours and torchrun set RANK, Open MPI its own names."""
    env = os.environ
    if "RANK" not in env and "OMPI_COMM_WORLD_RANK" in env:
        env["RANK"], env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", env["RANK"])
    return int(env["RANK"]), int(env["WORLD_SIZE"])


def main(argv: list[str]) -> int:
    """Entry point of one rank: ``python -m snapstate.bench.worker JOB.json``."""
    quiet_known_warnings()
    raw = load_job(argv[0])
    rank, world = rank_from_env()
    set_threads(world)
    init_distributed(rank, world)
    try:
        if raw["kind"] == "measure-batch":
            for spec in raw["jobs"]:
                run_job(MeasureJob(**{**spec, "train": TrainConfig(**spec["train"])}), rank, world)
        else:
            from snapstate.bench.determinism import train_on_rank

            train_on_rank(raw, rank, world)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Start ranks as real processes on 127.0.0.1 (the way torchrun would) and watch them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import snapstate.bench

WORKER_MODULE = "snapstate.bench.worker"


class WorkerError(RuntimeError):
    """A rank failed or timed out; carries the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distributed_env() -> tuple[int, int] | None:
    """(rank, world) when launched by torchrun or srun, else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "MASTER_ADDR" in env:
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_PORT", "29500")
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    return None


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(snapstate.bench.__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return env


@dataclass
class RankGroup:
    """The processes of one launch, with their logs."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def failed(self) -> int | None:
        """The first rank that exited non-zero, if any."""
        for rank, p in enumerate(self.procs):
            if p.poll() not in (None, 0):
                return rank
        return None

    def done(self) -> bool:
        return all(p.poll() == 0 for p in self.procs)

    def tail(self, rank: int, chars: int = 4000) -> str:
        try:
            return self.logs[rank].read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start(job_file: Path, world: int, log_dir: Path) -> RankGroup:
    """Start ``world`` worker processes running the job in ``job_file``."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(world):
        log = log_dir / f"rank{rank}.log"
        with open(log, "wb") as out:
            cmd = [sys.executable, "-m", WORKER_MODULE, str(job_file)]
            procs.append(
                subprocess.Popen(
                    cmd, env=_rank_env(rank, world, port), stdout=out, stderr=subprocess.STDOUT
                )
            )
        logs.append(log)
    return RankGroup(procs, logs)


def wait(group: RankGroup, timeout_s: float, until: Callable[[], bool] | None = None) -> None:
    """Wait until every rank exits 0 (or ``until()`` holds); kill all on failure or timeout."""
    deadline = time.monotonic() + timeout_s
    while not group.done():
        if until is not None and until():
            return
        bad = group.failed()
        if bad is not None:
            group.kill()
            raise WorkerError(
                f"rank {bad} failed (exit {group.procs[bad].returncode}):\n{group.tail(bad)}"
            )
        if time.monotonic() > deadline:
            group.kill()
            raise WorkerError(f"ranks timed out after {timeout_s:.0f} s:\n{group.tail(0)}")
        time.sleep(0.02)


def run(job_file: Path, world: int, log_dir: Path, timeout_s: float) -> None:
    """Start the ranks and wait for all of them to succeed."""
    wait(start(job_file, world, log_dir), timeout_s)

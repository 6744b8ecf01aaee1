"""Start ranks as real processes on 127.0.0.1 (the way torchrun would) and watch them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import snapstate.bench
from snapstate.bench.frameworks import get_framework, python_for

WORKER_MODULE = "snapstate.bench.worker"


class WorkerError(RuntimeError):
    """A rank failed or timed out; carries the tail of its log."""


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket stays bound until all are picked, so the OS
    cannot hand out one port twice (a TF worker would then fail to start its gRPC server)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


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


def _group_env(world: int, port: int) -> dict[str, str]:
    """What every rank of a launch shares: this source tree first, the rendezvous address."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "TF_CONFIG")}
    src = str(Path(snapstate.bench.__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return env


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {**_group_env(world, port), "RANK": str(rank), "LOCAL_RANK": str(rank)}


def tf_config(rank: int, ports: list[int]) -> str:
    """TF_CONFIG of worker ``rank`` in a MultiWorkerMirroredStrategy cluster on loopback."""
    workers = [f"127.0.0.1:{p}" for p in ports]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})


@dataclass
class RankGroup:
    """The processes of one launch, with their logs."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def kill(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # already gone, with everything it started
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


def start(job_file: Path, world: int, log_dir: Path, framework: str = "torch") -> RankGroup:
    """Start ``world`` ranks running the job in ``job_file``, in the framework's environment."""
    python = python_for(framework)
    if python is None:
        raise WorkerError(f"no Python environment for {framework} (see snapstate.bench.frameworks)")
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", WORKER_MODULE, str(job_file)]
    if get_framework(framework).launcher == "mpirun":
        return _start_mpirun(cmd, world, log_dir)
    port, *tf_ports = free_ports(1 + (world if framework == "tensorflow" else 0))
    procs, logs = [], []
    for rank in range(world):
        env = _rank_env(rank, world, port)
        if world > 1 and tf_ports:
            env["TF_CONFIG"] = tf_config(rank, tf_ports)
        logs.append(log_dir / f"rank{rank}.log")
        procs.append(_popen(cmd, env, logs[-1]))
    return RankGroup(procs, logs)


def _start_mpirun(cmd: list[str], world: int, log_dir: Path) -> RankGroup:
    """One ``mpirun`` for all ranks (ChainerMN's communicators need MPI); one log for all."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise WorkerError("mpirun not found: install Open MPI (openmpi-bin libopenmpi-dev)")
    env = _group_env(world, free_port())
    forward = [
        a
        for k in ("PYTHONPATH", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED")
        for a in ("-x", k)
    ]
    mpi = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(world), *forward]
    log = log_dir / "mpirun.log"
    return RankGroup([_popen(mpi + cmd, env, log)], [log])


def _popen(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    # A session of its own: a kill reaches everything the rank started (mpirun's ranks).
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


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


def run(
    job_file: Path, world: int, log_dir: Path, timeout_s: float, framework: str = "torch"
) -> None:
    """Start the ranks and wait for all of them to succeed."""
    retry_port_race(lambda: wait(start(job_file, world, log_dir, framework), timeout_s))


# A port picked free can still be taken (by another connection) before a TF worker binds it;
# the worker then dies at start, before training, so starting again with new ports is safe.
PORT_RACE = "Could not start gRPC server"


def retry_port_race(launch: Callable[[], None], attempts: int = 3) -> None:
    for attempt in range(1, attempts + 1):
        try:
            launch()
            return
        except WorkerError as e:
            if PORT_RACE not in str(e) or attempt == attempts:
                raise

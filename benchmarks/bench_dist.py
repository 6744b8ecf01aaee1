"""Distributed benchmark: snapstate vs torch.save on rank 0 vs DCP, on 2 and 4 gloo ranks, in one run.

A DDP-style state (every rank holds the same tensors, ``--size-mib`` in all) is saved by each
method in turn, interleaved and rotated each repeat, every rank timed from a barrier to a
barrier (so a job's time is its slowest rank's). Reported per method: median seconds, bytes
written by each rank, and the ratios the targets are about: the busiest rank's bytes against
total / N, and snapstate's save time against DCP's. Loads of the snapstate checkpoint are
measured both ways: read once and broadcast (the default) and every rank reading for itself.
Page cache is warm for loads (the files were just written); every save ends with fsync.

    .venv/bin/python benchmarks/bench_dist.py [--ranks 2,4] [--size-mib 512] [--repeats 3]
        [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

MiB = 1 << 20
METHODS = ("snapstate", "torch.save@rank0", "dcp")


# ---- rank side --------------------------------------------------------------------------------


def make_state(size_mib: int) -> dict[str, Any]:
    """Layers of a model: a few large matrices and many small ones, ``size_mib`` in all (float32)."""
    import torch

    g = torch.Generator().manual_seed(0)  # the same on every rank: DDP replicas
    big, small = size_mib * 3 // 4, size_mib - size_mib * 3 // 4
    state = {
        f"layers.{i}.weight": torch.randn(big * MiB // 8 // 4096, 1024, generator=g)
        for i in range(8)
    }
    state.update(
        {f"layers.{i}.norm": torch.randn(small * MiB // 64 // 4, generator=g) for i in range(64)}
    )
    return state


def dir_bytes(path: Path, rank_pattern: str | None = None) -> int:
    return sum(f.stat().st_size for f in path.rglob(rank_pattern or "*") if f.is_file())


def timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def save_snapstate(state: dict[str, Any], path: Path, out: dict[str, Any], rank: int) -> None:
    import snapstate as ss

    result = ss.save(state, path)
    out["bytes"] = result.bytes_written
    out["replica_check_s"] = result.timings.get("replica_check_s", 0.0)


def save_torch_rank0(state: dict[str, Any], path: Path, out: dict[str, Any], rank: int) -> None:
    import torch

    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    out["bytes"] = dir_bytes(path) if rank == 0 else 0


def save_dcp(state: dict[str, Any], path: Path, out: dict[str, Any], rank: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path))
    out["bytes"] = dir_bytes(path, f"__{rank}_*.distcp")


SAVES = {"snapstate": save_snapstate, "torch.save@rank0": save_torch_rank0, "dcp": save_dcp}


def worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import snapstate as ss

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
    )
    state = make_state(cfg["size_mib"])
    root = Path(cfg["dir"])
    samples: dict[str, list[dict[str, Any]]] = {
        m: [] for m in (*METHODS, "load read_once", "load every rank", "snapstate async stall")
    }
    for rep in range(cfg["repeats"] + 1):  # the first round warms up and is not kept
        order = METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]
        for name in order:
            path = root / f"{name}-{rep}"
            out: dict[str, Any] = {}
            os.sync()  # earlier writes leave the disk before this method starts
            out["seconds"] = timed(lambda: SAVES[name](state, path, out, rank))  # noqa: B023 - called at once
            if rep:
                samples[name].append(out)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        for read_once in (True, False):
            result: dict[str, Any] = {}

            def load() -> None:
                r = ss.load(target, root / f"snapstate-{rep}", read_once=read_once)  # noqa: B023
                result.update(bytes_read=r.bytes_read, bytes_received=r.bytes_received)  # noqa: B023

            result["seconds"] = timed(load)
            assert all(torch.equal(target[k], state[k]) for k in state)
            if rep:
                samples["load read_once" if read_once else "load every rank"].append(result)
        stall: dict[str, Any] = {}
        os.sync()
        dist.barrier()
        started = time.perf_counter()
        handle = ss.async_save(state, root / f"async-{rep}")
        stall["seconds"] = time.perf_counter() - started
        handle.wait()
        dist.barrier()
        if rep:
            samples["snapstate async stall"].append(stall)
        dist.barrier()
        if rank == 0:
            for p in root.glob(f"*-{rep}"):
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
    (root / f"result-{rank}.json").write_text(json.dumps(samples))
    dist.destroy_process_group()


# ---- parent side ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(world: int, cfg: dict[str, Any]) -> list[dict[str, list[dict[str, Any]]]]:
    root = Path(cfg["dir"])
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), str(world), str(port), json.dumps(cfg)],
            env=env,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + cfg["timeout"]
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(
                f"the {world}-rank job did not finish within {cfg['timeout']} s"
            ) from None
    if any(p.returncode for p in procs):
        raise SystemExit(
            f"a rank of the {world}-rank job failed: exit codes {[p.returncode for p in procs]}"
        )
    results = [json.loads((root / f"result-{r}.json").read_text()) for r in range(world)]
    shutil.rmtree(root, ignore_errors=True)
    return results


def summarize(
    world: int, results: list[dict[str, list[dict[str, Any]]]], size_mib: int
) -> dict[str, Any]:
    """Per method: median job seconds (slowest rank), bytes per rank (from the last repeat)."""
    out: dict[str, Any] = {"ranks": world, "state_mib": size_mib}
    for name in results[0]:
        reps = len(results[0][name])
        job = [max(results[r][name][i]["seconds"] for r in range(world)) for i in range(reps)]
        entry: dict[str, Any] = {
            "median_s": statistics.median(job),
            "min_s": min(job),
            "max_s": max(job),
        }
        last = [results[r][name][-1] for r in range(world)]
        for field in ("bytes", "bytes_read", "bytes_received", "replica_check_s"):
            if field in last[0]:
                entry[f"{field}_per_rank"] = [x[field] for x in last]
        out[name] = entry
    total = sum(out["snapstate"]["bytes_per_rank"])
    out["ratios"] = {
        "snapstate max bytes per rank / (total / N)": max(out["snapstate"]["bytes_per_rank"])
        / (total / world),
        "dcp max bytes per rank / (total / N)": max(out["dcp"]["bytes_per_rank"])
        / (sum(out["dcp"]["bytes_per_rank"]) / world),
        "snapstate total bytes / state bytes": total / (size_mib * MiB),
        "snapstate save s / dcp save s": out["snapstate"]["median_s"] / out["dcp"]["median_s"],
        "snapstate save s / torch.save@rank0 s": out["snapstate"]["median_s"]
        / out["torch.save@rank0"]["median_s"],
        "load read_once s / load every rank s": out["load read_once"]["median_s"]
        / out["load every rank"]["median_s"],
    }
    return out


def report(summaries: list[dict[str, Any]]) -> str:
    lines = []
    for s in summaries:
        lines.append(f"\n== {s['ranks']} ranks, {s['state_mib']} MiB state ==")
        for name in (*METHODS, "snapstate async stall", "load read_once", "load every rank"):
            e = s[name]
            per_rank = e.get("bytes_per_rank") or e.get("bytes_read_per_rank")
            what = "written" if "bytes_per_rank" in e else "read"
            mib = (
                f"  MiB {what} per rank: {[round(b / MiB, 1) for b in per_rank]}"
                if per_rank
                else ""
            )
            lines.append(
                f"  {name:22s} median {e['median_s']:.3f} s (min {e['min_s']:.3f}, max {e['max_s']:.3f}){mib}"
            )
        check = s["snapstate"].get("replica_check_s_per_rank")
        if check:
            lines.append(
                f"  snapstate replica check: {max(check):.3f} s hashing every replica, in a thread overlapping the save"
            )
        for k, v in s["ratios"].items():
            lines.append(f"  {k}: {v:.3f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--dir", default=None, help="where checkpoints are written [a temporary directory]"
    )
    p.add_argument("--json", default=None, help="write the summaries here")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="snapstate-bench-dist-"))
    summaries = []
    for world in (int(x) for x in args.ranks.split(",")):
        cfg = {
            "size_mib": args.size_mib,
            "repeats": args.repeats,
            "dir": str(base / f"n{world}"),
            "timeout": args.timeout,
        }
        summaries.append(summarize(world, run_job(world, cfg), args.size_mib))
        print(report(summaries[-1:]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=2))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        main()

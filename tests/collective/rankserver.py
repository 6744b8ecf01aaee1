"""Starts torch.distributed jobs for the tests: imports torch once, forks one process per rank.

Run as a script; it reads one JSON job per line on stdin and answers one JSON line when every
rank has exited or the job's timeout has passed (then the ranks left are SIGKILLed). A job is
``{"world": N, "fn": "collective.scen_x:function", "args": {...}, "work": dir, "timeout": s}``; rank r
runs ``function(rank, world, args)`` after joining a gloo group on 127.0.0.1 (rank 0 hosts
the store on a free port), and its return value (JSON) lands in ``work/result-<r>.json``.
This process never runs a torch op itself, so forking it is safe.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
# tests/: scenarios import as collective.scen_*, as pytest imports them
sys.path.insert(0, os.path.dirname(HERE))

import torch._dynamo  # noqa: E402,F401 - creating an optimizer imports it: seconds per rank, paid once here
import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401

import snapstate  # noqa: E402,F401

for _name in sorted(os.listdir(HERE)):
    if _name.startswith("scen_") and _name.endswith(".py"):
        importlib.import_module(f"collective.{_name[:-3]}")  # imported once here, before forking

STORE_WAIT_S = 30.0


def join_group(rank: int, world: int, work: str) -> None:
    """A gloo group whose TCP store rank 0 hosts on a port it picks itself (no port races)."""
    port_file = os.path.join(work, "store-port")
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            world,
            True,
            timeout=timedelta(seconds=STORE_WAIT_S),
            wait_for_workers=False,
        )
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(store.port))
        os.replace(tmp, port_file)
    else:
        deadline = time.monotonic() + STORE_WAIT_S
        while not os.path.exists(port_file):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never published the store port")
            time.sleep(0.01)
        with open(port_file) as f:
            port = int(f.read())
        store = dist.TCPStore(
            "127.0.0.1", port, world, False, timeout=timedelta(seconds=STORE_WAIT_S)
        )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )


def child(job: dict[str, Any], rank: int) -> None:
    work = job["work"]
    log = os.open(
        os.path.join(work, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
    )
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 0
    try:
        torch.set_num_threads(1)  # several ranks share two cores
        module, name = job["fn"].split(":")
        fn = getattr(importlib.import_module(module), name)
        if job["world"] > 0:
            join_group(rank, job["world"], work)
        result = fn(rank, max(job["world"], 1), job["args"])
        tmp = os.path.join(work, f"result-{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(work, f"result-{rank}.json"))
    except BaseException:  # noqa: BLE001 - reported through the exit code and the log
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no process-group teardown: a peer may be dead on purpose


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.makedirs(job["work"], exist_ok=True)
    pids = []
    for rank in range(max(job["world"], 1)):
        pid = os.fork()
        if pid == 0:
            child(job, rank)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + job["timeout"]
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    timed_out = len(codes) < len(pids)
    for rank, pid in enumerate(pids):
        if rank not in codes:
            os.kill(pid, signal.SIGKILL)
            codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return {"codes": [codes[r] for r in range(len(pids))], "timed_out": timed_out}


def main() -> None:
    for line in sys.stdin:
        reply = run(json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Rank side of the timeout tests: a rank stopped (SIGSTOP) just before a save."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import snapstate as ss


def stopped_before_save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 stops itself before ``save``; the others must give up after ``timeout``, not 30 min."""
    state = {"w": torch.arange(64.0), "step": 1}
    ss.save(state, args["path"] + "-before", timeout=args["timeout"])  # a cached plan, warm ranks
    pid_file = os.path.join(args["work"], f"pid-{rank}")
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    try:
        save = ss.async_save if args["mode"] == "async" else ss.save
        save(state, args["path"], timeout=args["timeout"])
        outcome, message = "saved", ""
    except ss.CheckpointError as exc:
        outcome, message = type(exc).__name__, str(exc)
    seconds = time.monotonic() - started
    if rank == 0:  # the stopped rank never returns: end it, so the job ends
        with open(os.path.join(args["work"], "pid-1")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    return {
        "outcome": outcome,
        "timeout_error": outcome.endswith("TimeoutError"),
        "message": message,
        "seconds": seconds,
    }

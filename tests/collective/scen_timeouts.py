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


def _stop_at_first_read(storage_cls: type) -> None:
    """This process stops itself (SIGSTOP) the first time it reads a shard's bytes."""
    for name in ("map_file", "read_into", "open_reader"):
        real = getattr(storage_cls, name)

        def stopping(self: Any, *a: Any, _real: Any = real, **k: Any) -> Any:
            os.kill(os.getpid(), signal.SIGSTOP)
            return _real(self, *a, **k)

        setattr(storage_cls, name, stopping)


def stopped_in_load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 stops in its first read of a load; the others must give up after ``timeout``
    with their state as it was."""
    from snapstate.storage.local import LocalStorage

    saved = {"w": torch.arange(4096.0), "shared": torch.ones(1024)}
    ss.save(saved, args["path"], timeout=args["timeout"])
    target = {"w": torch.zeros(4096), "shared": torch.zeros(1024)}
    ss.load(target, args["path"], read_once=args["read_once"], timeout=args["timeout"])  # warm
    target = {"w": torch.full((4096,), 7.0), "shared": torch.full((1024,), 7.0)}
    with open(os.path.join(args["work"], f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        _stop_at_first_read(LocalStorage)
    started = time.monotonic()
    try:
        ss.load(target, args["path"], read_once=args["read_once"], timeout=args["timeout"])
        outcome = "loaded"
    except ss.CheckpointError as exc:
        outcome = type(exc).__name__
    seconds = time.monotonic() - started
    if rank == 0:
        with open(os.path.join(args["work"], "pid-1")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    untouched = all(bool((t == 7.0).all()) for t in target.values())
    return {
        "timeout_error": outcome.endswith("TimeoutError"),
        "outcome": outcome,
        "seconds": seconds,
        "untouched": untouched,
    }

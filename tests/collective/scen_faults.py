"""Rank side of the fault tests: a rank SIGKILLed during persist; replicas perturbed on one rank."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import snapstate as ss
from snapstate.collective import replica_check
from snapstate.engine import persist
from snapstate.engine import save as save_engine
from snapstate.format import integrity

from .common import digest, pattern


def values(step: int) -> dict[str, torch.Tensor]:
    return {
        "w": pattern((256, 64), step),
        "b": pattern((300,), 100 + step),
        "e": pattern((64, 32), 200 + step, torch.bfloat16),
    }


def die_while_writing() -> None:
    """The next shard write lands on disk, then this process gets SIGKILL (from its persist thread)."""
    original = persist.RankWriter._write

    def write_then_die(self: Any, *args: Any) -> None:
        original(self, *args)
        os.kill(os.getpid(), signal.SIGKILL)

    persist.RankWriter._write = write_then_die  # type: ignore[method-assign]


def kill_during_persist(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    mgr = ss.CheckpointManager(args["root"], async_save=True, timeout=args["timeout"])
    state = {"model": values(1), "step": 1}
    mgr.save(1, state)
    mgr.wait()
    state = {"model": values(2), "step": 2}
    if rank == args["victim"]:
        die_while_writing()
    started = time.monotonic()
    handle = mgr.save(2, state)
    try:
        handle.wait()
        outcome, message = "committed", ""
    except ss.CheckpointError as exc:
        outcome, message = type(exc).__name__, str(exc)
    return {
        "outcome": outcome,
        "message": message,
        "timeout_error": isinstance(handle.error, ss.CheckpointTimeoutError),
        "seconds": time.monotonic() - started,
    }


def resume(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """A restarted job: the manager resumes from the latest committed step, then saves again."""
    mgr = ss.CheckpointManager(args["root"], async_save=True, timeout=args["timeout"])
    state = {"model": {k: torch.zeros_like(v) for k, v in values(0).items()}, "step": 0}
    step = mgr.restore(state)
    restored = {k: digest(v) for k, v in state["model"].items()}
    state = {"model": values(2), "step": 2}
    mgr.save(2, state)
    mgr.wait()
    return {
        "step": step,
        "restored": restored,
        "expected": {k: digest(v) for k, v in values(1).items()},
        "steps": mgr.steps(),
    }


def perturbed_replica(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    state = {"model": values(1), "note": "replicas"}
    # also caches the plan: the check must still run
    first = ss.save(state, args["path"] + "-before")
    if rank == args["odd"]:
        state["model"]["w"][17, 3] += 1e-3  # a replica that silently diverged
    out: dict[str, Any] = {"cached": None, "error": None}
    every_holder = ss.SaveOptions(replica_witnesses=None)  # names all holders in one save
    try:
        result = ss.save(state, args["path"], options=every_holder)
        out["cached"] = result.timings["plan_cached"]
    except ss.ReplicaMismatchError as exc:
        out["error"] = str(exc)
    unchecked = ss.save(
        state, args["path"] + "-unchecked", options=ss.SaveOptions(verify_replicas="off")
    )
    out["first_check_s"] = first.timings["replica_check_s"]
    out["unchecked"] = "replica_check_s" not in unchecked.timings
    return out


def perturbed_replica_rotating(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """The default check (one rotating witness per chunk) catches a diverged replica within
    holders - 1 saves; the saves before it that pass are real, committed checkpoints."""
    state = {"model": values(1)}
    mode = args.get("mode", "blocking")
    if mode in ("async-runs", "async-pieces"):
        # the witnessed chunks staged as a device's would be (in runs; in pieces when a
        # piece is smaller), not hashed where they lie in host memory
        save_engine.hashed_where_it_lies = lambda source, mode: False  # type: ignore[assignment]
    options = ss.SaveOptions(piece_bytes=32 << 10) if mode == "async-pieces" else None
    pool = ss.HostBufferPool(slab_bytes=32 << 10 if options else 64 << 20)

    def save(path: str) -> None:
        if mode == "blocking":
            ss.save(state, path)
        else:
            ss.async_save(state, path, pool=pool, options=options).wait()

    save(args["path"] + "-before")
    if rank == args["odd"]:
        state["model"]["w"][17, 3] += 1e-3
    for attempt in range(world - 1):
        try:
            save(f"{args['path']}-{attempt}")
        except ss.ReplicaMismatchError as exc:
            return {"caught_at": attempt, "error": str(exc)}
    return {"caught_at": None, "error": None}


def dead_before_save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 dies before the save begins; the others must not hang in its first collective."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    started = time.monotonic()
    try:
        ss.save({"model": values(1)}, args["path"], timeout=args["timeout"])
        outcome = "saved"
    except ss.CheckpointError as exc:
        outcome = type(exc).__name__
    return {
        "outcome": outcome,
        "timeout_error": outcome.endswith("TimeoutError"),
        "seconds": time.monotonic() - started,
    }


def witness_snapshot(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Every rank changes its (replicated) tensors the moment ``async_save`` returns, while
    its witness hashes are slowed down: they still hash the values being saved (the save
    waits for them), so the commit finds no mismatch and the checkpoint holds those values."""

    class SlowHasher(integrity.BlockHasher):
        def update(self, data: memoryview) -> None:
            time.sleep(0.05)
            super().update(data)

    replica_check.BlockHasher = SlowHasher  # type: ignore[misc]
    state = {"model": {"w": pattern((256, 64), 7), "b": pattern((300,), 8)}}
    before = {k: digest(v) for k, v in state["model"].items()}
    handle = ss.async_save(state, args["path"])
    with torch.no_grad():
        state["model"]["w"].add_(1.0)
        state["model"]["b"].mul_(2.0)
    handle.wait()
    restored = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    ss.load(restored, args["path"])
    return {"saved": {k: digest(v) for k, v in restored["model"].items()} == before}

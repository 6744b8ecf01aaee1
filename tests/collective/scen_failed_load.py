"""Rank side of the failed-load test: a corrupt byte that only rank 1 reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import snapstate as ss
from fault.corrupt import edit_manifest
from snapstate.engine import load as load_mod
from support.pagecache import drop_cached_pages

from .common import pattern


def _state(rank: int, step: int) -> dict[str, Any]:
    return {
        "w": pattern((256, 64), step),
        "mine": ss.RankLocal({"x": pattern((16384,), 10 * rank + step)}),  # pages past the header
        "step": step,
    }


def _corrupt_rank_local(path: str, rank: int) -> None:
    record = ss.inspect(path).rank_local[rank].tensors
    chunk = next(iter(record.values())).chunks[0]
    with open(Path(path) / chunk.file, "r+b") as f:
        f.seek(chunk.start + 5)
        byte = f.read(1)
        f.seek(chunk.start + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def corrupt_on_one_rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Save, corrupt rank 1's own bytes, load with the given transport on every rank (from a
    cold page cache when ``args["cold"]``)."""
    ss.save(_state(rank, 1), args["path"])
    dist.barrier()
    if rank == 0:
        _corrupt_rank_local(args["path"], 1)
        if args.get("cold"):
            drop_cached_pages(args["path"])
    dist.barrier()
    state = _state(rank, 2)
    before = _state(rank, 2)
    error = ""
    kept_ahead = []
    real_rollback = load_mod.Rollback

    def recording(reads: list[Any], *, ahead: bool = False) -> Any:
        kept_ahead.append(ahead)
        return real_rollback(reads, ahead=ahead)

    load_mod.Rollback = recording  # type: ignore[assignment,misc]
    real_can_map = load_mod.can_map
    if args.get("cold"):  # read in place, as a state beyond a quarter of memory is
        load_mod.can_map = lambda *_: False  # type: ignore[assignment]
    try:
        ss.load(state, args["path"], read_once=args["read_once"])
    except ss.CheckpointError as exc:
        error = type(exc).__name__
    finally:
        load_mod.Rollback = real_rollback  # type: ignore[misc]
        load_mod.can_map = real_can_map  # type: ignore[assignment]
    unchanged = (
        torch.equal(state["w"], before["w"])
        and torch.equal(state["mine"].value["x"], before["mine"].value["x"])
        and state["step"] == 2
    )
    return {"error": error, "unchanged": unchanged, "kept_ahead": kept_ahead == [True]}


def retyped_manifest(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Save, reseal the manifest with w as int32 (the shard header still says F32), load into
    an int32 target with the given transport on every rank (issue 31 item 7)."""
    ss.save(_state(rank, 1), args["path"])
    dist.barrier()
    if rank == 0:
        edit_manifest(Path(args["path"]), _retype_w)
    dist.barrier()
    state = _state(rank, 2) | {"w": torch.full((256, 64), 7, dtype=torch.int32)}
    error = ""
    try:
        ss.load(state, args["path"], read_once=args["read_once"])
    except ss.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    unchanged = torch.equal(state["w"], torch.full((256, 64), 7, dtype=torch.int32))
    return {"error": error, "unchanged": unchanged and state["step"] == 2}


def _retype_w(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["dtype"] = "int32"

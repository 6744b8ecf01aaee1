"""The replica check: hashes of replicated tensors compared across ranks at save.

DDP replicas that silently diverged (a rank-dependent op, a missed all-reduce) would
otherwise be saved from whichever rank the planner picked, and the others' values lost
without a trace. Every rank hashes the replicas it holds, in a thread that overlaps the
save's own copies and writes, and lists the hashes in its marker; the coordinator compares
them before it commits, so the check costs no collective: a mismatch means no manifest and
a ReplicaMismatchError naming keys and ranks on every rank. An async save waits for its
hashes before it returns: after that the caller may change the tensors.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import xxhash

from snapstate.engine.staging import byte_view, row_pieces
from snapstate.errors import ReplicaMismatchError
from snapstate.planning.replicas import ReplicaGroup, divergences
from snapstate.state.dtensor import source_view
from snapstate.state.flatten import FlatState

HASH_PIECE_BYTES = 64 << 20
_P = 65521  # position weights of the device fingerprint


def fingerprint(t: torch.Tensor) -> str:
    """xxh3-64 of the tensor's bytes on CPU; an exact-arithmetic checksum on other devices."""
    if t.device.type != "cpu":
        return device_fingerprint(t)
    h = xxhash.xxh3_64()
    for _, piece in row_pieces(t.detach(), HASH_PIECE_BYTES):
        h.update(byte_view(piece.contiguous()))
    return h.hexdigest()


def device_fingerprint(t: torch.Tensor) -> str:
    """Sum and position-weighted sum of the bytes, computed where the tensor lives (no host copy)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    plain = weighted = 0
    for start in range(0, flat.numel(), HASH_PIECE_BYTES):
        piece = flat[start : start + HASH_PIECE_BYTES].to(torch.int64)
        weights = (
            torch.arange(start, start + piece.numel(), device=piece.device, dtype=torch.int64) % _P
            + 1
        )
        plain += int(piece.sum())
        weighted += int((piece * weights).sum())
    return f"dev{flat.numel():x}:{plain:x}:{weighted:x}"


class ReplicaHasher:
    """Hashes this rank's replicas in the background: ``{group index: [hash per box]}``."""

    def __init__(self, flat: FlatState, groups: list[ReplicaGroup], rank: int) -> None:
        self.hashes: dict[int, list[str]] = {}
        self.seconds = 0.0
        self._error: BaseException | None = None
        mine = [(i, g) for i, g in enumerate(groups) if rank in g.ranks]
        self._thread = threading.Thread(
            target=self._run, args=(flat, mine), name="snapstate-replica-hash", daemon=True
        )
        self._thread.start()

    def _run(self, flat: FlatState, mine: list[tuple[int, ReplicaGroup]]) -> None:
        started = time.perf_counter()
        try:
            with torch.no_grad():
                for i, g in mine:
                    self.hashes[i] = [
                        fingerprint(source_view(flat.tensors[key], box)) for key, box in g.boxes
                    ]
        except BaseException as exc:  # noqa: BLE001 - raised by result()
            self._error = exc
        self.seconds = time.perf_counter() - started

    def result(self) -> dict[int, list[str]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.hashes


PER_RANK_HINT = (
    "Likely cause: state that is per rank by nature (a data loader, sampler or generator of "
    "your own, per-rank counters) placed as a replica. Fix: wrap it in ss.RankLocal(...) so "
    "each rank saves its own copy, or turn the check off with "
    "SaveOptions(verify_replicas='off') if the ranks may differ and rank 0's copy will do."
)


def check_markers(groups: list[ReplicaGroup], markers: list[dict[str, Any]]) -> None:
    """Coordinator, before committing: every group's members listed the same hashes."""
    per_rank = [{int(i): h for i, h in m.get("replicas", {}).items()} for m in markers]
    bad = [
        i for i, g in enumerate(groups) if len({tuple(per_rank[r].get(i, ())) for r in g.ranks}) > 1
    ]
    if not bad:
        return
    found = divergences(groups, bad, per_rank)
    lines = "\n  ".join(d.describe() for d in found[:20])
    more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
    raise ReplicaMismatchError(
        f"replicated tensors differ across ranks; nothing was committed:\n  {lines}{more}\n"
        f"{PER_RANK_HINT}"
    )

"""The replica check: each replicated chunk's writer compared with the ranks that witness it.

DDP replicas that silently diverged (a rank-dependent op, a missed all-reduce) would
otherwise be saved from whichever rank the planner picked, and the others' values lost
without a trace. Each chunk of a replicated box is written (and checksummed) by one rank;
the other holders, its witnesses (all of them, or a rotating share: ``SaveOptions.
replica_witnesses``), hash their own copy in a background thread and list the hashes in
their markers. The coordinator compares them with the writer's checksums before it commits,
so the check costs no collective; an async save waits only for the part of its hashing that
outlasts its own staging copies (it hashes host memory where it lies, which must not change
before it is read). A mismatch means no manifest and a ReplicaMismatchError naming keys and
ranks on every rank.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from snapstate.errors import ReplicaMismatchError
from snapstate.format.integrity import BlockHasher
from snapstate.format.marker import Marker
from snapstate.planning.items import Box
from snapstate.planning.replicas import Divergence, ReplicaGroup, divergences
from snapstate.state.views import StagedBytes, bits_view, byte_view, row_pieces

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


class WitnessHasher:
    """Hashes, on a background thread, this rank's copy of chunks other ranks write.

    The digests are xxh3 blocks like the writer's own checksums, so the coordinator compares
    them with what the writer's marker reports; the writer's side costs nothing extra. Chunks
    in host memory are hashed where they lie while the save stages its own share (an async
    save waits for them, ``mark``, before it returns); chunks on a device are staged first.
    """

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.digests: dict[str, tuple[str, ...]] = {}
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="snapstate-witness", daemon=True)
        self._thread.start()

    def submit(self, name: str, data: StagedBytes | torch.Tensor, last: bool) -> None:
        """Bytes of chunk ``name``, in order: staged (async) or a tensor in memory (blocking)."""
        self._jobs.put((((name, 0, None, last),), data))

    def submit_run(self, parts: list[tuple[str, int, int]], staged: StagedBytes) -> None:
        """Whole chunks staged together: (name, first byte, end byte) of each in ``staged``."""
        self._jobs.put((tuple((n, b, e, True) for n, b, e in parts), staged))

    def mark(self) -> threading.Event:
        """An event set once every chunk submitted so far is hashed (or the hashing failed)."""
        done = threading.Event()
        self._jobs.put(done)
        return done

    def close(self) -> None:
        self._jobs.put(None)

    def result(self) -> dict[str, tuple[str, ...]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.digests

    def _run(self) -> None:
        started = time.perf_counter()
        hashers: dict[str, BlockHasher] = {}
        while (job := self._jobs.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
                continue
            parts, data = job
            try:
                if self._error is None:
                    whole = _bytes_of(data)
                    for name, begin, end, last in parts:
                        hasher = hashers.setdefault(name, BlockHasher(self.block_bytes))
                        hasher.update(whole[begin:end])
                        if last:
                            self.digests[name] = tuple(hashers.pop(name).finish())
            except BaseException as exc:  # noqa: BLE001 - raised by result()
                self._error = self._error or exc
            finally:
                if isinstance(data, StagedBytes) and data.release:
                    data.release()
        self.seconds = time.perf_counter() - started


PER_RANK_HINT = (
    "Likely cause: state that is per rank by nature (a data loader, sampler or generator of "
    "your own, per-rank counters) placed as a replica. Fix: wrap it in ss.RankLocal(...) so "
    "each rank saves its own copy, or, if the ranks may differ and rank 0's copy will do, write "
    "rank 0's copy unchecked with SaveOptions(unchecked_replicas=('<key>',)) or for all keys "
    "with SaveOptions(verify_replicas='off')."
)


def _bytes_of(data: StagedBytes | torch.Tensor) -> memoryview:
    if isinstance(data, StagedBytes):
        if data.ready:
            data.ready()
        return data.data
    return byte_view(bits_view(data.detach()).cpu().contiguous())


def check_witnesses(markers: Sequence[Marker]) -> None:
    """Coordinator, before committing: every witness hashed what the writer wrote."""
    written = {c.name: (m.rank, c) for m in markers for c in m.chunks}
    found = []
    for name in sorted({n for m in markers for n in m.replicas}):
        rank, chunk = written[name]
        # witnesses hash raw bytes; a compressed chunk's xxh3 covers its stored ones
        by_hash: dict[str, list[int]] = {_label(chunk.raw_xxh3 or chunk.xxh3): [rank]}
        for m in markers:
            if name in m.replicas:
                by_hash.setdefault(_label(m.replicas[name]), []).append(m.rank)
        if len(by_hash) > 1:
            box = Box(chunk.offsets, chunk.sizes)
            found.append(
                Divergence(chunk.key, box, {h: tuple(sorted(r)) for h, r in by_hash.items()})
            )
    if found:
        _raise_divergences(found)


def _label(blocks: Sequence[str]) -> str:
    """One hash standing for a chunk's block hashes (the block hash itself for one block)."""
    return blocks[0] if len(blocks) == 1 else xxhash.xxh3_64_hexdigest(",".join(blocks).encode())


def _raise_divergences(found: list[Divergence]) -> None:
    lines = "\n  ".join(d.describe() for d in found[:20])
    more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
    raise ReplicaMismatchError(
        f"replicated tensors differ across ranks; nothing was committed:\n  {lines}{more}\n"
        f"{PER_RANK_HINT}"
    )


def check_markers(groups: list[ReplicaGroup], markers: Sequence[dict[str, Any]]) -> None:
    """Whole-group comparison of per-group hash lists (``{"replicas": {group: [hash per box]}}``).

    The save itself no longer produces such lists (see ``check_witnesses``); kept for tools
    and tests that compare replica groups' hashes gathered by other means.
    """
    per_rank = [{int(i): list(h) for i, h in m.get("replicas", {}).items()} for m in markers]
    bad = [
        i for i, g in enumerate(groups) if len({tuple(per_rank[r].get(i, ())) for r in g.ranks}) > 1
    ]
    if bad:
        _raise_divergences(divergences(groups, bad, per_rank))

"""Plan caching: reuse the last plan while every rank's structure stays the same (pure).

A rank alone cannot tell that the plan is still valid, since another rank's state may have
changed, so each rank offers a digest of its item metadata, and the cached plan is used
only if every rank offers the same cache token. The metadata itself travels only when the
digest changed, so a steady training loop exchanges a few bytes per save, not the metadata.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any

import xxhash

from snapstate.planning.items import ItemMeta
from snapstate.planning.layout import SavePlan
from snapstate.planning.metatable import MetaTable


class Decision(str, Enum):
    REUSE = "reuse"  # every rank holds the same cached plan and its structure is unchanged
    PLAN = "plan"  # every rank sent its metadata: plan from it
    REGATHER = "regather"  # mixed: some ranks hit their cache, others did not; gather metadata


@dataclass(frozen=True)
class Offer:
    """What a rank sends before planning."""

    digest: str  # of its metadata (and the plan options)
    token: str | None  # the cache token it would reuse, if its digest is unchanged
    metas: MetaTable | list[ItemMeta] | None  # sent only when it cannot reuse (a table)
    save_id: str
    tree_digest: str


@dataclass
class CacheEntry:
    token: str
    digest: str
    plan: SavePlan
    extra: Any = None  # what else was derived from the same metadata (shared replicas)
    witness: Any = None  # this rank's witness candidates (planning/replicas.py)
    saves: int = 0  # saves that used this entry: the turn of rotating replica witnesses


@dataclass(frozen=True)
class LocalStructure:
    """What this rank derived from its state's structure last time (reused while it holds)."""

    key: Any  # structure_key of the flattened state
    metas: list[ItemMeta]
    digest: str  # metas_digest of ``metas`` with ``digest_of`` options
    digest_of: Any
    tree: Any = None
    tree_digest: str = ""


class PlanCache:
    """The last plan of one process group.

    Safe to share between threads that save at once: each save reads one snapshot of an
    entry (a single attribute read) and uses that snapshot throughout, never the attribute
    again, so a concurrent save that replaces the entry cannot hand it another state's plan.
    """

    def __init__(self) -> None:
        self.entry: CacheEntry | None = None
        self.local: LocalStructure | None = None
        self.hits = 0
        self._lock = threading.Lock()

    def snapshot(self, digest: str) -> CacheEntry | None:
        """The cached entry if it was planned from metadata of this ``digest``."""
        entry = self.entry
        return entry if entry is not None and entry.digest == digest else None

    def token_for(self, digest: str) -> str | None:
        entry = self.snapshot(digest)
        return entry.token if entry is not None else None

    def store(self, entry: CacheEntry) -> None:
        with self._lock:
            self.entry = entry

    def hit(self) -> None:
        with self._lock:
            self.hits += 1

    def turn(self, entry: CacheEntry) -> int:
        """The number of saves before this one that used ``entry`` (same on every rank)."""
        with self._lock:
            entry.saves += 1
            return entry.saves - 1


def metas_digest(metas: list[ItemMeta], options: Any) -> str:
    h = xxhash.xxh3_128(repr(options).encode())
    for m in metas:
        h.update(repr((m.key, m.dtype, m.shape, m.placement.value, m.boxes, m.from_rank0)).encode())
    return h.hexdigest()


def combined_token(offers: list[Offer]) -> str:
    h = xxhash.xxh3_128()
    for o in offers:
        h.update(o.digest.encode())
    return h.hexdigest()


def decide(offers: list[Offer]) -> Decision:
    """The same answer on every rank, since every rank sees the same offers."""
    tokens = {o.token for o in offers}
    if len(tokens) == 1 and None not in tokens:
        return Decision.REUSE
    if all(o.metas is not None for o in offers):
        return Decision.PLAN
    return Decision.REGATHER

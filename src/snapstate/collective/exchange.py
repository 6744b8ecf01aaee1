"""The metadata exchange before a save: one all_gather, the plan from cache when every rank agrees."""

from __future__ import annotations

import json
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import xxhash

from snapstate.collective.coordinator import Coordinator, gather_or_raise
from snapstate.planning.cache import (
    CacheEntry,
    Decision,
    LocalStructure,
    Offer,
    PlanCache,
    combined_token,
    decide,
    metas_digest,
)
from snapstate.planning.holdings import gather_holdings
from snapstate.planning.items import ItemMeta
from snapstate.planning.layout import PlanOptions, SavePlan, plan_from
from snapstate.planning.metatable import MetaTable, pack
from snapstate.planning.replicas import ReplicaGroup, WitnessItem, groups_from, witness_candidates
from snapstate.state.flatten import FlatState

_caches: weakref.WeakKeyDictionary[Any, PlanCache] = weakref.WeakKeyDictionary()


@dataclass
class AgreedPlan:
    """What every rank agreed on before staging."""

    flat: FlatState  # this rank's state, taken apart
    plan: SavePlan
    save_id: str  # rank 0's, shared by every rank
    replicas: list[ReplicaGroup]
    tree_differs: bool  # this rank's structure differs from rank 0's (its marker carries it)
    cached: bool
    witness: list[WitnessItem] = field(default_factory=list)  # chunks this rank may witness
    turn: int = 0  # saves before this one with the same plan (rotates the witnesses)


def cache_for(coord: Coordinator) -> PlanCache:
    try:
        return _caches.setdefault(coord, PlanCache())
    except TypeError:  # a coordinator that cannot be weakly referenced: no caching
        return PlanCache()


def tree_digest(tree: dict[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(
        json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()
    )


def exchange_plan(
    coord: Coordinator,
    local: Callable[[], tuple[FlatState, list[ItemMeta]]],
    options: PlanOptions,
    timeout: float | None = None,
) -> AgreedPlan:
    """Gather offers (and metadata when needed); every rank derives the same plan.

    ``timeout`` bounds each gather (see ``gather_or_raise``).
    """
    cache = cache_for(coord)
    mine: list[tuple[FlatState, list[ItemMeta], CacheEntry | None]] = []

    def offer() -> Offer:
        flat, metas = local()
        digest = _digest(cache, metas, (options, coord.world_size))
        entry = cache.snapshot(digest)  # this save's view of the cache, see PlanCache
        mine.append((flat, metas, entry))
        token = entry.token if entry is not None else None
        return Offer(
            digest,
            token,
            None if token else pack(metas),
            uuid.uuid4().hex,
            _tree_digest(cache, flat),
        )

    offers = gather_or_raise(coord, offer, timeout)
    flat, metas, entry = mine[0]
    decision = decide(offers)
    if decision is Decision.REUSE:
        assert entry is not None
        cache.hit()
    else:
        if decision is Decision.PLAN:
            all_metas = [o.metas if o.metas is not None else [] for o in offers]
        else:
            all_metas = gather_or_raise(coord, lambda: pack(metas), timeout)
        entry = _new_entry(coord.rank, offers, all_metas, options)
        cache.store(entry)
    return AgreedPlan(
        flat,
        entry.plan,
        offers[0].save_id,
        entry.extra,
        offers[coord.rank].tree_digest != offers[0].tree_digest,
        decision is Decision.REUSE,
        entry.witness,
        cache.turn(entry),
    )


def _new_entry(
    rank: int,
    offers: list[Offer],
    all_metas: Sequence[Sequence[ItemMeta] | MetaTable],
    options: PlanOptions,
) -> CacheEntry:
    """Plan from every rank's metadata, with what this rank derives from the same plan."""
    holdings = gather_holdings(all_metas)  # one pass over every rank's metadata, for both
    plan = plan_from(holdings, options)
    return CacheEntry(
        combined_token(offers),
        offers[rank].digest,
        plan,
        groups_from(holdings),
        witness_candidates(plan, rank),
    )


def local_metas(
    coord: Coordinator, flat: FlatState, compute: Callable[[FlatState], list[ItemMeta]]
) -> list[ItemMeta]:
    """This rank's item metadata: the last save's list while the structure is unchanged.

    The check (``structure_key``) costs a tuple per tensor; the metadata and its digest cost
    several times that, and an unchanged list also reuses its digest (``_digest``).
    """
    cache = cache_for(coord)
    key = structure_key(flat)
    known = cache.local
    if key is not None and known is not None and known.key == key:
        return known.metas
    metas = compute(flat)
    if key is not None:
        cache.local = LocalStructure(key, metas, "", None)
    return metas


def structure_key(flat: FlatState) -> tuple[Any, ...] | None:
    """What item metadata depends on, for plain tensors; None (never cached) for others."""
    parts: list[Any] = []
    for tensors in (flat.tensors, flat.rank_local_tensors):
        for k, t in tensors.items():
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                return None  # a DTensor's boxes depend on its mesh and placements
            parts.append((k, t.dtype, t.shape, t.device))
        parts.append(None)  # separates the two dicts
    return (tuple(parts), frozenset(flat.rank0_keys))


def _digest(cache: PlanCache, metas: list[ItemMeta], options: Any) -> str:
    known = cache.local
    if known is not None and known.metas is metas and known.digest and known.digest_of == options:
        return known.digest
    digest = metas_digest(metas, options)
    if known is not None and known.metas is metas:
        cache.local = replace(known, digest=digest, digest_of=options)
    return digest


def _tree_digest(cache: PlanCache, flat: FlatState) -> str:
    known = cache.local
    if known is not None and known.tree_digest and known.tree == flat.tree:
        return known.tree_digest
    digest = tree_digest(flat.tree)
    if known is not None:
        cache.local = replace(known, tree=flat.tree, tree_digest=digest)
    return digest

"""The metadata exchange before a save: one all_gather, the plan from cache when every rank agrees."""

from __future__ import annotations

import json
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from snapstate.collective.coordinator import Coordinator, gather_or_raise
from snapstate.planning.cache import (
    CacheEntry,
    Decision,
    Offer,
    PlanCache,
    combined_token,
    decide,
    metas_digest,
)
from snapstate.planning.items import ItemMeta
from snapstate.planning.layout import PlanOptions, SavePlan, plan_save
from snapstate.planning.replicas import ReplicaGroup, replica_groups
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
    coord: Coordinator, local: Callable[[], tuple[FlatState, list[ItemMeta]]], options: PlanOptions
) -> AgreedPlan:
    """Gather offers (and metadata when needed); every rank derives the same plan."""
    cache = cache_for(coord)
    mine: list[tuple[FlatState, list[ItemMeta]]] = []

    def offer() -> Offer:
        flat, metas = local()
        mine.append((flat, metas))
        digest = metas_digest(metas, (options, coord.world_size))
        token = cache.token_for(digest)
        return Offer(
            digest, token, None if token else metas, uuid.uuid4().hex, tree_digest(flat.tree)
        )

    offers = gather_or_raise(coord, offer)
    flat, metas = mine[0]
    decision = decide(offers)
    if decision is Decision.REUSE:
        assert cache.entry is not None
        cache.hits += 1
        entry = cache.entry
    else:
        if decision is Decision.PLAN:
            all_metas = [o.metas or [] for o in offers]
        else:
            all_metas = gather_or_raise(coord, lambda: metas)
        plan = plan_save(all_metas, options)
        entry = CacheEntry(
            combined_token(offers), offers[coord.rank].digest, plan, replica_groups(all_metas)
        )
        cache.entry = entry
    return AgreedPlan(
        flat,
        entry.plan,
        offers[0].save_id,
        entry.extra,
        offers[coord.rank].tree_digest != offers[0].tree_digest,
        decision is Decision.REUSE,
    )

"""Replica witnesses: who hashes which replicated chunk, and the rotation's coverage."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.engine.options import SaveOptions
from snapstate.engine.save import start_save
from snapstate.planning.items import Box, ItemMeta, Placement
from snapstate.planning.layout import PlanOptions, plan_save
from snapstate.planning.replicas import replica_groups, witness_candidates, witnessed_by
from snapstate.storage.local import LocalStorage

from .sim import SimCoordinator, World


def _replicated(world: int, keys: int) -> list[list[ItemMeta]]:
    def meta(i: int) -> ItemMeta:
        return ItemMeta(f"k{i}", "float32", (8, 4), 4, Placement.REPLICATE, (Box.full((8, 4)),))

    return [[meta(i) for i in range(keys)] for _ in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_holder_witnesses_every_chunk_it_does_not_write(world: int) -> None:
    metas = _replicated(world, 10)
    plan = plan_save(metas, PlanOptions())
    for rank in range(world):
        items = witnessed_by(witness_candidates(plan, rank), rank, 0, None)
        written = {i.key for i in plan.items[rank]}
        assert {i.key for i in items} == {f"k{i}" for i in range(10)} - written


@pytest.mark.parametrize("world", [3, 4])
def test_rotating_witnesses_cover_every_pair_and_hash_the_state_once(world: int) -> None:
    metas = _replicated(world, 12)
    plan = plan_save(metas, PlanOptions())
    writer = {i.key: r for r, items in enumerate(plan.items) for i in items}
    pairs = set()
    for turn in range(world - 1):
        hashed = 0
        for rank in range(world):
            cands = witness_candidates(plan, rank)
            for item in witnessed_by(cands, rank, turn, 1):
                pairs.add((item.key, rank))
                hashed += 1
        assert hashed == 12  # one witness per chunk: O(state) per save, not (world - 1) x
    expected = {(k, r) for k, w in writer.items() for r in range(world) if r != w}
    assert pairs == expected  # over world - 1 saves, every holder was compared with the writer


def test_rotating_witness_catches_a_divergence_within_n_saves(tmp_path: Path) -> None:
    world = World(3)
    opts = SaveOptions(timeout=20, replica_witnesses=1)

    def run(coord: SimCoordinator) -> list[str]:
        w = torch.arange(12.0).reshape(4, 3)
        if coord.rank == 2:
            w[1, 1] += 1e-4  # a replica that silently diverged
        state = {"w": w, "b": torch.ones(3)}
        out = []
        for i in range(2):
            storage = LocalStorage(str(tmp_path / f"c{i}"))
            try:
                start_save(state, storage, coord, pool=None, step=i, options=opts).wait()
                out.append("ok")
            except ss.ReplicaMismatchError as exc:
                out.append(str(exc))
        return out

    results = world.run(run)
    assert all(r == results[0] for r in results)
    caught = [m for m in results[0] if m != "ok"]
    assert caught and all("'w'" in m and "rank(s) [2] hold" in m for m in caught)
    assert all("'b'" not in m for m in caught)


def test_async_witnesses_hash_the_values_of_the_call(tmp_path: Path) -> None:
    """The witness share is staged: changing the tensors after async_save returns is safe."""
    world = World(2)

    def run(coord: SimCoordinator) -> object:
        state = {"w": torch.arange(4096.0)}
        storage = LocalStorage(str(tmp_path / "c"))
        pool = ss.HostBufferPool(8 << 20, slab_bytes=1 << 20)
        handle = start_save(
            state, storage, coord, pool=pool, step=0, options=SaveOptions(timeout=20)
        )
        state["w"].add_(float(coord.rank + 1))  # ranks diverge only after the call
        return handle.wait()

    assert all(isinstance(r, ss.SaveResult) for r in world.run(run))
    target = {"w": torch.zeros(4096)}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["w"], torch.arange(4096.0))


def _random_layout(rng: random.Random, world: int) -> list[list[ItemMeta]]:
    """Replicated, sharded (split over the ranks, some shards empty), rank-0-only and
    rank-local keys, as a save of a DP x TP job gathers them."""
    metas: list[list[ItemMeta]] = [[] for _ in range(world)]
    for k in range(rng.randint(1, 6)):
        shape = (rng.randint(0, 9), 3)
        kind = rng.choice(["replicate", "shard", "local", "rank0"])
        per = -(-shape[0] // world)
        for r in range(world):
            if kind == "shard":
                lo = min(shape[0], r * per)
                box = Box((lo, 0), (min(shape[0], lo + per) - lo, 3))
                placement = Placement.SHARD
            else:
                box = Box.full(shape)
                placement = Placement.RANK_LOCAL if kind == "local" else Placement.REPLICATE
            metas[r].append(
                ItemMeta(f"k{k}", "float32", shape, 4, placement, (box,), kind == "rank0")
            )
    return metas


def _inside(inner: Box, outer: Box) -> bool:
    return all(
        o <= i and i + s <= o + n
        for i, s, o, n in zip(inner.offsets, inner.sizes, outer.offsets, outer.sizes)
    )


@pytest.mark.parametrize("seed", range(40))
def test_witnesses_are_the_chunks_others_write_inside_this_ranks_replicas(seed: int) -> None:
    # the definition, checked by brute force over every written chunk and every replica group
    rng = random.Random(seed)
    world = rng.randint(1, 5)
    metas = _random_layout(rng, world)
    plan = plan_save(metas, PlanOptions(chunk_bytes=rng.choice([12, 24, 1000])))
    groups = replica_groups(metas)
    for rank in range(world):
        expected = set()
        for writer_items in plan.items:
            for item in writer_items:
                if item.rank == rank:
                    continue
                for g in groups:
                    inside = any(k == item.key and _inside(item.box, b) for k, b in g.boxes)
                    if rank in g.ranks and item.rank in g.ranks and inside:
                        others = tuple(r for r in g.ranks if r != item.rank)
                        expected.add((item, others))
        got = {(w.item, w.others) for w in witness_candidates(plan, rank)}
        assert got == expected

"""Who writes what: replicated data once in total and balanced, each DTensor box once (pure)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapstate.planning.items import Box, ItemMeta, Placement
from snapstate.planning.layout import PlanOptions, SavePlan, plan_save

CHUNK = 1 << 10


def replicated(key: str, shape: tuple[int, ...], itemsize: int = 4) -> ItemMeta:
    return ItemMeta(
        key,
        "float32" if itemsize == 4 else "bfloat16",
        shape,
        itemsize,
        Placement.REPLICATE,
        (Box.full(shape),),
    )


def shard_rows(key: str, shape: tuple[int, ...], rank: int, world: int) -> ItemMeta:
    step = -(-shape[0] // world)
    lo = min(rank * step, shape[0])
    box = Box((lo, *([0] * (len(shape) - 1))), (max(0, min(step, shape[0] - lo)), *shape[1:]))
    return ItemMeta(key, "float32", shape, 4, Placement.SHARD, (box,))


def written(plan: SavePlan) -> dict[str, list[tuple[Box, int]]]:
    out: dict[str, list[tuple[Box, int]]] = {}
    for rp in plan.ranks:
        for f in rp.files:
            for p in f.items:
                out.setdefault(p.item.key, []).append((p.item.box, rp.rank))
    return out


def assert_tiles(shape: tuple[int, ...], boxes: list[Box]) -> None:
    assert sum(b.numel for b in boxes) == math.prod(shape)
    cells = {cell for b in boxes for cell in _cells(b)}
    assert len(cells) == math.prod(shape)  # no overlap, nothing missing


def _cells(box: Box) -> list[tuple[int, ...]]:
    import itertools

    return list(itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes))))


def tensor_bytes(plan: SavePlan) -> list[int]:
    return [sum(p.item.nbytes for f in rp.files for p in f.items) for rp in plan.ranks]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ddp_state_is_written_once_and_balanced(world: int) -> None:
    specs = {"emb": (100, 37), "w1": (64, 64), "w2": (33, 17), "b": (5,), "s": ()}
    metas = [[replicated(k, s) for k, s in specs.items()] for _ in range(world)]
    plan = plan_save(metas, PlanOptions(chunk_bytes=CHUNK))
    by_key = written(plan)
    for key, shape in specs.items():
        assert_tiles(shape, [b for b, _ in by_key[key]])
    loads = tensor_bytes(plan)
    total = sum(math.prod(s) * 4 for s in specs.values())
    assert sum(loads) == total
    assert max(loads) <= total / world + CHUNK


def test_dtensor_boxes_once_each_by_a_holder_and_replicas_spread() -> None:
    world = 4
    # 2-D mesh (2 x 2): "a" Shard(0) on mesh dim 1 and Replicate on mesh dim 0: pairs of ranks hold the same box
    metas = []
    for rank in range(world):
        row = rank % 2
        metas.append(
            [
                ItemMeta("a", "float32", (8, 4), 4, Placement.SHARD, (Box((4 * row, 0), (4, 4)),)),
                shard_rows("u", (7, 3), rank, world),  # uneven: 2, 2, 2, 1
                shard_rows("t", (3,), rank, world),  # fewer rows than ranks: rank 3 holds nothing
            ]
        )
    plan = plan_save(metas, PlanOptions(chunk_bytes=CHUNK))
    by_key = written(plan)
    for key, shape in {"a": (8, 4), "u": (7, 3), "t": (3,)}.items():
        assert_tiles(shape, [b for b, _ in by_key[key]])
        assert all(b.numel > 0 for b, _ in by_key[key])  # no empty chunk for an empty shard
    writers = {b.offsets: r for b, r in by_key["a"]}
    # written by a rank that holds it
    assert writers[(0, 0)] in (0, 2) and writers[(4, 0)] in (
        1,
        3,
    )
    assert len(set(r for _, r in by_key["a"])) == 2


def test_rank_local_state_is_written_by_its_rank() -> None:
    metas = [
        [
            ItemMeta("rng/torch", "uint8", (816,), 1, Placement.RANK_LOCAL, (Box.full((816,)),)),
            replicated("w", (10,)),
        ]
        for _ in range(3)
    ]
    plan = plan_save(metas, PlanOptions(chunk_bytes=CHUNK))
    for rp in plan.ranks:
        names = [p.item.name for f in rp.files for p in f.items]
        assert f"rank{rp.rank}/rng/torch@0" in names


def test_keys_held_by_some_ranks_only_pipeline_stages() -> None:
    metas = [[replicated(f"stage{r // 2}/w", (40, 10))] for r in range(4)]
    plan = plan_save(metas, PlanOptions(chunk_bytes=CHUNK))
    by_key = written(plan)
    assert {r for _, r in by_key["stage0/w"]} == {0, 1} and {r for _, r in by_key["stage1/w"]} == {
        2,
        3,
    }


def test_same_plan_on_every_rank_and_files_hold_everything() -> None:
    metas = [[replicated("w", (300, 7)), shard_rows("s", (9, 9), r, 3)] for r in range(3)]
    a, b = (
        plan_save(metas, PlanOptions(chunk_bytes=CHUNK)),
        plan_save(metas, PlanOptions(chunk_bytes=CHUNK)),
    )
    assert a == b
    for rp in a.ranks:
        for f in rp.files:
            assert f.path.startswith(f"shards/r{rp.rank:05d}-")
            ends = [p.end for p in f.items]
            assert max(ends) == f.size  # one buffer without holes after the header


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 6),
    shapes=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 9)), min_size=1, max_size=6),
    chunk=st.sampled_from([64, 256, 1024]),
)
def test_balance_bound_holds_for_any_ddp_state(
    world: int, shapes: list[tuple[int, int]], chunk: int
) -> None:
    metas = [[replicated(f"t{i}", s) for i, s in enumerate(shapes)] for _ in range(world)]
    loads = tensor_bytes(plan_save(metas, PlanOptions(chunk_bytes=chunk)))
    total = sum(math.prod(s) * 4 for s in shapes)
    biggest_row = max(s[1] * 4 for s in shapes)
    assert sum(loads) == total
    assert max(loads) <= total / world + max(chunk, biggest_row)

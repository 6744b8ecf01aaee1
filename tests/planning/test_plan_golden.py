"""The planner's output is that of the straightforward reference planner (reference_planner.py),
chunk for chunk and writer for writer, on plan-sim meshes and on hand-made edge cases."""

from __future__ import annotations

import pytest

from planning.reference_planner import reference_plan, reference_problems
from snapstate.errors import InconsistentStateError
from snapstate.planning.holdings import gather_holdings
from snapstate.planning.items import Box, ItemMeta, Placement
from snapstate.planning.layout import PlanOptions, plan_files, plan_save, write_item
from snapstate.planning.metatable import pack, unpack
from snapstate.planning.replicas import groups_from
from snapstate.plansim import Model, SimConfig, _coord_key, _mesh, rank_metas


def sim_metas(cfg: SimConfig) -> list[list[ItemMeta]]:
    mesh = _mesh(cfg)
    by_coord = rank_metas(Model.named(cfg.model), mesh, cfg)
    return [by_coord[_coord_key(mesh.coords(r), cfg)] for r in range(cfg.ranks)]


def meta(key: str, shape: tuple[int, ...], boxes: tuple[Box, ...], **kw: object) -> ItemMeta:
    placement = kw.pop("placement", Placement.SHARD)
    return ItemMeta(key, "float32", shape, 4, placement, boxes, **kw)  # type: ignore[arg-type]


def edge_metas(world: int) -> list[list[ItemMeta]]:
    """Rank-local state, a rank-0 key, empty shards, a 0-d and a 3-d tensor, two boxes on one
    rank, a replicated tensor split in chunks."""
    out = []
    for r in range(world):
        rows = Box((r, 0), (1 if r < 2 else 0, 3))  # 2 rows over `world` ranks: empty shards
        two = (Box((0,), (2,)), Box((2,), (2,))) if r == 0 else (Box((4,), (4,)),)
        out.append(
            [
                meta("w", (4096, 8), (Box.full((4096, 8)),), placement=Placement.REPLICATE),
                meta("rows", (2, 3), (rows,)),
                meta("step", (), (Box.full(()),), placement=Placement.REPLICATE),
                meta("cube", (2, 2, 2), (Box.full((2, 2, 2)),), placement=Placement.REPLICATE),
                meta(
                    "buf", (16,), (Box.full((16,)),), placement=Placement.REPLICATE, from_rank0=True
                ),
                meta("split", (8,), two),
                meta("rng", (5 + r,), (Box.full((5 + r,)),), placement=Placement.RANK_LOCAL),
            ]
        )
    return out


CASES = {
    "empty-ranks-3": (
        lambda: [[], edge_metas(1)[0], []],
        1 << 12,
    ),
    "zero-16": (
        lambda: sim_metas(SimConfig(ranks=16, model="1b", tp=2, pp=2, shard_optimizer=True)),
        32 << 20,
    ),
    "dp-tp-pp-16": (lambda: sim_metas(SimConfig(ranks=16, model="1b", tp=2, pp=4)), 8 << 20),
    "sgd-8": (
        lambda: sim_metas(
            SimConfig(ranks=8, model="1b", tp=2, pp=2, optimizer="sgd", shard_optimizer=True)
        ),
        64 << 20,
    ),
    "edges-1": (lambda: edge_metas(1), 1 << 12),
    "edges-5": (lambda: edge_metas(5), 1 << 12),
    "ddp-4": (
        lambda: [
            [
                meta(
                    f"p{i}", (300 + i, 7), (Box.full((300 + i, 7)),), placement=Placement.REPLICATE
                )
                for i in range(9)
            ]
            for _ in range(4)
        ],
        1 << 12,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_is_the_reference_plan(case: str) -> None:
    make, chunk_bytes = CASES[case]
    all_metas = make()
    options = PlanOptions(chunk_bytes=chunk_bytes, max_file_bytes=1 << 24)
    plan = plan_save(all_metas, options)
    items, given = reference_plan(all_metas, chunk_bytes)
    assert [list(plan.items_of(r)) for r in range(len(all_metas))] == items
    assert [(write_item(f.chunk, w), f.ranks) for f, w in plan.assignment.flexible] == given
    for r in range(len(all_metas)):
        assert plan.for_rank(r).files == tuple(plan_files(r, items[r], 1 << 24))
    assert list(plan.assignment.loads) == [sum(i.nbytes for i in its) for its in items]
    # the same plan from the tables the exchange sends
    assert plan_save([pack(m) for m in all_metas], options).assignment == plan.assignment


@pytest.mark.parametrize("case", sorted(CASES))
def test_tables_round_trip_and_groups_hold_every_shared_box(case: str) -> None:
    all_metas = CASES[case][0]()
    assert [unpack(pack(m)) for m in all_metas] == all_metas
    holders: dict[tuple[str, Box], list[int]] = {}
    for rank, metas in enumerate(all_metas):
        for m in metas:
            if m.placement is not Placement.RANK_LOCAL:
                for b in m.boxes:
                    holders.setdefault((m.key, b), []).append(rank)
    expected: dict[tuple[int, ...], list[tuple[str, Box]]] = {}
    for (key, box), ranks in holders.items():
        from_rank0 = next(m.from_rank0 for m in all_metas[ranks[0]] if m.key == key)
        if len(ranks) > 1 and box.numel and not from_rank0:
            expected.setdefault(tuple(ranks), []).append((key, box))
    groups = groups_from(gather_holdings(all_metas))
    assert {g.ranks: sorted(g.boxes, key=lambda kb: (kb[0], kb[1].offsets)) for g in groups} == {
        r: sorted(b, key=lambda kb: (kb[0], kb[1].offsets)) for r, b in expected.items()
    }


def test_disagreements_are_described_as_before() -> None:
    all_metas = edge_metas(4)
    all_metas[2] = [
        meta("w", (4096, 9), (Box.full((4096, 9)),), placement=Placement.REPLICATE),
        *all_metas[2][1:],
    ]
    all_metas[3] = [replace_dtype(m) if m.key == "cube" else m for m in all_metas[3]]
    holdings = gather_holdings(all_metas)
    assert holdings.problems == reference_problems(all_metas)
    assert len(holdings.problems) == 2
    with pytest.raises(InconsistentStateError, match="'cube'"):
        plan_save(all_metas)


def replace_dtype(m: ItemMeta) -> ItemMeta:
    return ItemMeta(m.key, "float64", m.shape, 8, m.placement, m.boxes, m.from_rank0)


def test_tables_keep_values_beyond_int32() -> None:
    big = (1 << 40, 3)  # offsets past 2**31: the table keeps int64 columns
    metas = [
        meta("huge", big, (Box((1 << 39, 0), (4, 3)),), placement=Placement.SHARD),
        meta("small", (4,), (Box.full((4,)),), placement=Placement.REPLICATE),
    ]
    assert unpack(pack(metas)) == metas
    other = [meta("huge", big, (Box((1 << 38, 0), (4, 3)),)), metas[1]]
    plan = plan_save([metas, other])
    assert [i.box for i in plan.items_of(0) if i.key == "huge"] == [metas[0].boxes[0]]
    assert [i.box for i in plan.items_of(1) if i.key == "huge"] == [other[0].boxes[0]]

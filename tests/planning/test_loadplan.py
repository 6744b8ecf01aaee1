"""Loading: N-D overlaps for resharding, read-once planning, merged structures (pure)."""

from __future__ import annotations

import itertools
import math

import pytest
from click.testing import CliRunner

from snapstate.cli import main as cli
from snapstate.errors import ReplicaMismatchError
from snapstate.planning.items import Box, ItemMeta, Placement
from snapstate.planning.readplan import Span, plan_reads
from snapstate.planning.replicas import divergences, replica_groups
from snapstate.planning.reshard import overlap
from snapstate.planning.trees import merge_trees
from snapstate.plansim import SimConfig, simulate


def grid(shape: tuple[int, int], parts: tuple[int, int]) -> list[Box]:
    """Boxes of ``shape`` split torch.chunk-style into parts[0] x parts[1] (uneven allowed)."""

    def cuts(n: int, k: int) -> list[tuple[int, int]]:
        step = -(-n // k)
        return [(lo, min(step, n - lo)) for lo in range(0, n, step)]

    return [
        Box((r0, c0), (rn, cn))
        for (r0, rn), (c0, cn) in itertools.product(
            cuts(shape[0], parts[0]), cuts(shape[1], parts[1])
        )
    ]


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((8, 1), (3, 1)), ((2, 1), (1, 3)), ((2, 2), (1, 1)), ((4, 3), (3, 4)), ((1, 1), (7, 2))],
)
def test_resharding_overlaps_cover_each_target_exactly(
    saved: tuple[int, int], loaded: tuple[int, int]
) -> None:
    shape = (13, 11)
    stored = grid(shape, saved)
    for target in grid(shape, loaded):
        parts = [p for c in stored if (p := overlap(c, target)) is not None]
        assert sum(p.numel for p in parts) == target.numel
        cells = {
            cell
            for p in parts
            for cell in itertools.product(*(range(o, o + s) for o, s in zip(p.offsets, p.sizes)))
        }
        assert len(cells) == target.numel


def test_read_once_plan() -> None:
    a, b, c, d = Span("f0", 0, 100), Span("f0", 100, 300), Span("f1", 0, 50), Span("f1", 50, 60)
    needs = [[a, b, c], [a, b], [a, b, d]]
    plan = plan_reads(needs, batch_bytes=250)
    assert set(plan.readers) == {a, b}  # c and d are needed by one rank each: read by it
    assert plan.readers[b] != plan.readers[a]  # the biggest shared spans go to different ranks
    read = [plan.reads_for(r, needs[r]) for r in range(3)]
    # each span read once in the job
    assert sorted(s for r in read for s in r) == sorted([a, b, c, d])
    for batch in plan.batches:
        assert batch.reader not in batch.receivers and set(batch.receivers) <= {0, 1, 2}
        assert batch.nbytes <= 250 or len(batch.spans) == 1
    assert plan == plan_reads(needs, batch_bytes=250)


def test_read_once_plan_batches_small_spans_together() -> None:
    spans = [Span("f", i * 10, i * 10 + 10) for i in range(100)]
    plan = plan_reads([spans, spans], batch_bytes=200)
    assert sum(len(b.spans) for b in plan.batches) == 100
    assert len(plan.batches) <= 12
    loads = [sum(s.nbytes for s, r in plan.readers.items() if r == rank) for rank in (0, 1)]
    assert abs(loads[0] - loads[1]) <= 10


def test_replica_groups_and_divergences() -> None:
    def meta(key: str, box: Box) -> ItemMeta:
        return ItemMeta(key, "float32", (4, 4), 4, Placement.SHARD, (box,))

    top, bottom = Box((0, 0), (2, 4)), Box((2, 0), (2, 4))
    metas = [[meta("a", top)], [meta("a", bottom)], [meta("a", top)], [meta("a", bottom)]]
    groups = replica_groups(metas)
    assert [g.ranks for g in groups] == [(0, 2), (1, 3)]
    from snapstate.collective.replica_check import check_markers

    agree = [
        {"replicas": {"0": ["x"]}},
        {"replicas": {"1": ["y"]}},
        {"replicas": {"0": ["x"]}},
        {"replicas": {"1": ["y"]}},
    ]
    check_markers(groups, agree)
    differ = [*agree[:3], {"replicas": {"1": ["z"]}}]
    with pytest.raises(
        ReplicaMismatchError,
        match=r"'a' \(box at \[2, 0\]\): rank\(s\) \[1\] hold xxh3 y; rank\(s\) \[3\] hold xxh3 z",
    ):
        check_markers(groups, differ)
    found = divergences(groups, [1], [{}, {1: ["y"]}, {}, {1: ["z"]}])
    assert len(found) == 1 and "'a' (box at [2, 0])" in found[0].describe()


def test_merge_trees_unions_dicts() -> None:
    a = {"d": [["model", {"s": {"d": [["l0", {"t": "model/l0"}]]}}], ["epoch", {"v": 1}]]}
    b = {"d": [["model", {"s": {"d": [["l1", {"t": "model/l1"}]]}}], ["epoch", {"v": 2}]]}
    merged = merge_trees(a, [b])
    model = dict(merged["d"])["model"]["s"]["d"]
    assert [k for k, _ in model] == ["l0", "l1"]
    assert dict(merged["d"])["epoch"] == {"v": 1}  # rank 0's value wins
    assert merge_trees(a, []) is a


def test_plan_sim_small_job() -> None:
    report = simulate(SimConfig(ranks=32, model="1b", tp=4, pp=2))
    n = report.model["params"]
    # bf16 weights + fp32 master, exp_avg, exp_avg_sq (+ headers)
    assert report.state_bytes > n * 14
    assert report.state_bytes < n * 14 * 1.01
    assert report.bytes_per_rank["max"] <= report.ideal_max_bytes * 1.1
    assert report.files == 32 and report.manifest_bytes > 0
    assert report.predicted_save_s < report.rank0_only_save_s
    sharded = simulate(SimConfig(ranks=32, model="1b", tp=4, pp=2, shard_optimizer=True))
    assert math.isclose(sharded.state_bytes, report.state_bytes, rel_tol=0.01)


def test_plan_sim_cli() -> None:
    out = CliRunner().invoke(
        cli, ["plan-sim", "--ranks", "16", "--tp", "2", "--pp", "2", "--model", "500m"]
    )
    assert out.exit_code == 0, out.output
    assert "bytes per rank: min" in out.output and "predicted save" in out.output
    bad = CliRunner().invoke(cli, ["plan-sim", "--ranks", "10", "--tp", "4", "--pp", "2"])
    assert bad.exit_code != 0 and "does not make 10 ranks" in bad.output

"""ElasticSampler in one process, ranks simulated: the global order survives any change of world size."""

from __future__ import annotations

import pytest

from snapstate.data import ElasticSampler


def run(samplers: list[ElasticSampler], steps: int | None) -> list[int]:
    """Lockstep: each rank takes one sample per step until ``steps`` or the epoch ends."""
    its = [iter(s) for s in samplers]
    seen: list[int] = []
    step = 0
    while steps is None or step < steps:
        got = [next(it, None) for it in its]
        if all(g is None for g in got):
            break
        seen.extend(g for g in got if g is not None)
        step += 1
    return seen


def ranks(world: int, **kw: object) -> list[ElasticSampler]:
    return [ElasticSampler(50, num_replicas=world, rank=r, seed=3, **kw) for r in range(world)]  # type: ignore[arg-type]


def test_one_epoch_on_any_world_size_is_the_dataset_once() -> None:
    for world in (1, 2, 3, 4, 7):
        seen = run(ranks(world), None)
        assert sorted(seen) == list(range(50))
    assert ranks(3)[0].order(0) == ranks(1)[0].order(0) != ranks(1)[0].order(1)


@pytest.mark.parametrize(
    ("before", "after", "steps"), [(2, 3, 7), (3, 2, 5), (4, 1, 3), (2, 4, 1), (3, 3, 16)]
)
def test_resumed_on_another_world_size_continues_the_same_order(
    before: int, after: int, steps: int
) -> None:
    first = ranks(before)
    seen = run(first, steps)
    states = [s.state_dict() for s in first]
    assert all(st == states[0] for st in states)  # the same on every rank: saved once
    assert states[0]["consumed"] == len(seen)
    second = ranks(after)
    for s in second:
        s.load_state_dict(states[0])
    rest = run(second, None)
    assert sorted(seen + rest) == list(range(50))  # every sample once, none twice
    order = first[0].order(0)
    assert set(seen) == set(order[: len(seen)]) and set(rest) == set(order[len(seen) :])
    assert second[0].epoch == 1 and second[0].state_dict()["consumed"] == 0  # the next epoch begins


def test_len_and_drop_last() -> None:
    assert [len(s) for s in ranks(3)] == [17, 17, 16]
    dropped = ranks(3, drop_last=True)
    assert [len(s) for s in dropped] == [16, 16, 16]
    assert len(set(run(dropped, None))) == 48


def test_manual_count_ignores_prefetching() -> None:
    samplers = ranks(2, count="manual")
    its = [iter(s) for s in samplers]
    for it in its:
        for _ in range(10):  # a loader fetched 10 ahead...
            next(it)
    for s in samplers:
        s.advance(4)  # ...but training used 4 per rank
    assert samplers[0].state_dict()["consumed"] == 8


def test_set_epoch_and_mismatched_state() -> None:
    s = ranks(2)[0]
    run([s, ranks(2)[1]], 3)
    s.set_epoch(0)  # same epoch: keeps the position (a resumed loop calls set_epoch again)
    assert s.state_dict()["epoch"] == 0
    s.set_epoch(5)
    assert s.state_dict() == {"epoch": 5, "consumed": 0, "seed": 3, "size": 50, "shuffle": True}
    with pytest.raises(ValueError, match="seed=4"):
        ElasticSampler(50, num_replicas=1, rank=0, seed=4).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="rank 2"):
        ElasticSampler(50, num_replicas=2, rank=2)

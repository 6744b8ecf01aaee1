"""The plug-ins' version ids: agreed across ranks once per run, then derived alike on every rank."""

from __future__ import annotations

from snapstate.integrations._publish import VersionIds


def test_ranks_agree_once_then_derive_the_same_ids_without_talking() -> None:
    calls: list[str] = []

    def rank0_value(value: str) -> str:  # what a broadcast from rank 0 gives every rank
        calls.append(value)
        return "token0"

    ranks = [VersionIds(rank0_value), VersionIds(rank0_value)]
    ids = [[r.next() for _ in range(3)] for r in ranks]
    assert ids[0] == ids[1] == ["token0-1", "token0-2", "token0-3"]
    assert len(calls) == 2  # one agreement per rank, at its first save


def test_two_runs_never_reuse_an_id() -> None:
    first = VersionIds(lambda v: v)
    second = VersionIds(lambda v: v)
    seen = {first.next() for _ in range(5)} | {second.next() for _ in range(5)}
    assert len(seen) == 10

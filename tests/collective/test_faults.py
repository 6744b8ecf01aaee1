"""A rank killed during persist: no manifest, a timeout on the others, the earlier step still loads."""

from __future__ import annotations

from pathlib import Path

import pytest

import snapstate as ss

from .common import digest
from .launch import RankServer
from .scen_faults import values

pytestmark = pytest.mark.dist

TIMEOUT = 4.0


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-hosting-the-store"])
def test_sigkill_during_persist(ranks: RankServer, tmp_path: Path, victim: int) -> None:
    root = tmp_path / "root"
    args = {"root": str(root), "timeout": TIMEOUT, "victim": victim}
    job = ranks.run(
        "collective.scen_faults:kill_during_persist", 3, args, tmp_path / "killed", timeout=60
    )
    assert job.codes[victim] == -9 and not job.timed_out, job.describe()
    survivors = [r for i, r in enumerate(job.results) if i != victim]
    assert all(c == 0 for i, c in enumerate(job.codes) if i != victim), job.describe()
    for r in survivors:
        # CheckpointTimeoutError (StoreLostError when the store's host died)
        assert r["timeout_error"], r
        assert r["seconds"] < TIMEOUT + 10
        if victim != 0:
            assert f"rank {victim} did not arrive" in r["message"]
    assert not (root / "step-000000002" / "manifest.json").exists()  # nothing committed
    state = {"model": {k: v.clone().zero_() for k, v in values(0).items()}, "step": 0}
    ss.load(state, root / "step-000000001")  # the earlier checkpoint still loads
    assert {k: digest(v) for k, v in state["model"].items()} == {
        k: digest(v) for k, v in values(1).items()
    }
    assert state["step"] == 1
    resumed = ranks.run("collective.scen_faults:resume", 3, args, tmp_path / "resumed").check()
    for r in resumed:
        assert r["step"] == 1 and r["restored"] == r["expected"]
        assert r["steps"] == [1, 2]
    assert ss.verify(root / "step-000000002").ok


def test_rank_dead_before_the_save(ranks: RankServer, tmp_path: Path) -> None:
    args = {"path": str(tmp_path / "ckpt"), "timeout": TIMEOUT}
    job = ranks.run(
        "collective.scen_faults:dead_before_save", 3, args, tmp_path / "job", timeout=60
    )
    assert job.codes[1] == -9 and not job.timed_out, job.describe()
    for r in (job.results[0], job.results[2]):
        assert r["timeout_error"] and r["seconds"] < TIMEOUT + 30, r
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


@pytest.mark.parametrize("world", [2, 3])
def test_perturbed_replica_is_caught(ranks: RankServer, tmp_path: Path, world: int) -> None:
    args = {"path": str(tmp_path / "ckpt"), "odd": 1}
    results = ranks.run(
        "collective.scen_faults:perturbed_replica", world, args, tmp_path / "job"
    ).check()
    for r in results:
        message = r["error"]
        assert message is not None and "'model/w'" in message, r
        assert "rank(s) [1] hold" in message
        assert ("rank(s) [0, 2] hold" if world == 3 else "rank(s) [0] hold") in message
        assert "'model/b'" not in message  # only what differs
        assert r["first_check_s"] > 0 and r["unchecked"]
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
    assert ss.inspect(str(tmp_path / "ckpt-unchecked")).world_size == world


@pytest.mark.parametrize(
    ("world", "mode"),
    [(2, "blocking"), (3, "blocking"), (2, "async"), (3, "async-runs"), (2, "async-pieces")],
)
def test_rotating_witness_catches_a_diverged_replica_within_holders_minus_one_saves(
    ranks: RankServer, tmp_path: Path, world: int, mode: str
) -> None:
    args = {"path": str(tmp_path / "ckpt"), "odd": 1, "mode": mode}
    results = ranks.run(
        "collective.scen_faults:perturbed_replica_rotating", world, args, tmp_path / "job"
    ).check()
    caught = {r["caught_at"] for r in results}
    assert len(caught) == 1 and None not in caught, results  # every rank raised, same save
    for r in results:
        assert "'model/w'" in r["error"] and "rank(s) [1] hold" in r["error"]
    failed = tmp_path / f"ckpt-{caught.pop()}"
    assert not (failed / "manifest.json").exists()


def test_async_witnesses_hash_the_saved_values(ranks: RankServer, tmp_path: Path) -> None:
    """The replicas an async save witnesses in host memory are hashed before it returns."""
    args = {"path": str(tmp_path / "ckpt")}
    results = ranks.run(
        "collective.scen_faults:witness_snapshot", 2, args, tmp_path / "job"
    ).check()
    assert all(r["saved"] for r in results), results

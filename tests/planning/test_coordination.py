"""Plan caching, the replica check, the commit barrier and error propagation, on simulated ranks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.collective.barrier import StoreBarrier, store_barrier
from snapstate.collective.coordinator import gather_or_raise
from snapstate.collective.exchange import exchange_plan
from snapstate.collective.replica_check import device_fingerprint, fingerprint
from snapstate.engine.options import SaveOptions
from snapstate.engine.save import start_save
from snapstate.planning.cache import Decision, Offer, decide
from snapstate.planning.layout import PlanOptions
from snapstate.state.dtensor import item_meta
from snapstate.state.flatten import flatten_state
from snapstate.storage.local import LocalStorage

from .sim import SimCoordinator, World


def _local(state: dict) -> tuple:
    flat = flatten_state(state)
    return flat, [item_meta(k, t, False) for k, t in flat.tensors.items()]


def test_decide() -> None:
    def offer(token: str | None, metas: list | None) -> Offer:
        return Offer("d", token, metas, "id", "t")

    assert decide([offer("x", None), offer("x", None)]) is Decision.REUSE
    assert decide([offer(None, []), offer(None, [])]) is Decision.PLAN
    assert decide([offer("x", None), offer(None, [])]) is Decision.REGATHER
    assert decide([offer("x", None), offer("y", None)]) is Decision.REGATHER


def test_plan_cache_is_reused_only_when_every_rank_agrees() -> None:
    world = World(3)
    base = {"w": torch.zeros(40, 3), "b": torch.zeros(5)}

    def run(coord: SimCoordinator) -> list[tuple[bool, int, str]]:
        out = []
        for round_ in range(4):
            state = dict(base)
            if round_ == 2 and coord.rank == 1:
                state["extra"] = torch.zeros(2)  # only rank 1 changes: nobody may reuse
            agreed = exchange_plan(coord, lambda: _local(state), PlanOptions(chunk_bytes=64))  # noqa: B023 - called at once
            keys = sorted(agreed.plan.metas)
            out.append((agreed.cached, len(keys), agreed.save_id))
        return out

    results = world.run(run)
    assert all(r == results[0] for r in results)  # the same decisions and save ids on every rank
    assert [c for c, _, _ in results[0]] == [False, True, False, False]
    assert [n for _, n, _ in results[0]] == [2, 2, 3, 2]
    assert len({sid for _, _, sid in results[0]}) == 4


def _save_on(world: World, tmp_path: Path, state_for: object, **options: object) -> list[object]:
    storage = LocalStorage(str(tmp_path / "ckpt"))

    def run(coord: SimCoordinator) -> object:
        state = state_for(coord.rank)  # type: ignore[operator]
        opts = SaveOptions(timeout=20, **options)  # type: ignore[arg-type]
        try:
            return start_save(state, storage, coord, pool=None, step=1, options=opts).wait()
        except ss.CheckpointError as exc:
            return exc

    return world.run(run)


def test_replica_check_names_key_and_ranks(tmp_path: Path) -> None:
    def state(rank: int) -> dict:
        w = torch.arange(12.0).reshape(4, 3)
        if rank == 2:
            w[1, 1] += 1e-4  # a replica that silently diverged
        return {"w": w, "b": torch.ones(3)}

    # every holder hashes (not the default rotating witness), so one save names them all
    results = _save_on(World(3), tmp_path, state, replica_witnesses=None)
    for exc in results:
        assert isinstance(exc, ss.ReplicaMismatchError), exc
        message = str(exc)
        assert (
            "'w'" in message and "rank(s) [0, 1] hold" in message and "rank(s) [2] hold" in message
        )
        assert "'b'" not in message
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
    unchecked = _save_on(World(3), tmp_path, state, verify_replicas="off")
    assert all(isinstance(r, ss.SaveResult) for r in unchecked)


def test_replica_check_passes_equal_replicas(tmp_path: Path) -> None:
    # non-contiguous
    results = _save_on(World(2), tmp_path, lambda rank: {"w": torch.arange(12.0).reshape(4, 3).t()})
    assert all(isinstance(r, ss.SaveResult) and r.timings["replica_check_s"] > 0 for r in results)


def test_fingerprints_see_any_change() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    u = t.clone()
    u[500] = torch.nextafter(u[500], torch.tensor(1e9))
    assert fingerprint(t) == fingerprint(t.clone()) != fingerprint(u)
    assert device_fingerprint(t) == device_fingerprint(t.clone()) != device_fingerprint(u)
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert device_fingerprint(swapped) != device_fingerprint(t)  # positions count, not just the sum


def test_store_barrier_times_out_naming_the_absent_rank() -> None:
    world = World(3)

    def run(coord: SimCoordinator) -> tuple[str, float]:
        if coord.rank == 1:
            return "absent", 0.0
        started = time.monotonic()
        with pytest.raises(ss.CheckpointTimeoutError) as info:
            store_barrier(coord, "b1", timeout=0.5)
        return str(info.value), time.monotonic() - started

    results = world.run(run)
    for message, seconds in (results[0], results[2]):
        assert "rank 1 did not arrive" in message and seconds < 5


def test_store_barrier_passes_and_cleans_up() -> None:
    world = World(4)
    world.run(lambda coord: store_barrier(coord, "b2", timeout=5))
    assert world.store.missing(["b2/decision", "b2/acks", "b2/arrived/0"]) == [
        "b2/decision",
        "b2/acks",
        "b2/arrived/0",
    ]


def test_a_rank_reporting_failure_fails_the_barrier_everywhere() -> None:
    world = World(3)

    def run(coord: SimCoordinator) -> str:
        barrier = StoreBarrier(coord, "b3")
        if coord.rank == 2:
            barrier.arrive("error: OSError: disk full")
            return "reported"  # and gone: nobody may wait for it to read the decision
        with pytest.raises(ss.CheckpointError, match="disk full"):
            store_barrier(coord, "b3", timeout=30)
        return "raised"

    started = time.monotonic()
    assert world.run(run) == ["raised", "raised", "reported"]
    assert time.monotonic() - started < 15  # well before the 30 s timeout


def test_an_error_on_one_rank_is_raised_on_all() -> None:
    world = World(3)

    def run(coord: SimCoordinator) -> str:
        def work() -> int:
            if coord.rank == 1:
                raise KeyError("boom")
            return coord.rank

        try:
            gather_or_raise(coord, work)
        except KeyError:
            return "own"
        except ss.CheckpointWorkerError as exc:
            assert exc.failures[0].rank == 1 and "boom" in exc.failures[0].error
            return "worker"
        return "none"

    assert world.run(run) == ["worker", "own", "worker"]


def test_whole_save_on_simulated_ranks_commits_once(tmp_path: Path) -> None:
    world = World(3)
    storage = LocalStorage(str(tmp_path / "ckpt"))

    def run(coord: SimCoordinator) -> int:
        state = {
            "w": torch.arange(3000.0).reshape(300, 10),
            "rank": ss.RankLocal({"r": torch.tensor([coord.rank])}),
        }
        options = SaveOptions(plan=PlanOptions(chunk_bytes=1024), timeout=10)
        return (
            start_save(
                state,
                storage,
                coord,
                pool=ss.HostBufferPool(1 << 20, 1 << 16),
                step=7,
                options=options,
            )
            .wait()
            .bytes_written
        )

    written = world.run(run)
    manifest = ss.inspect(str(tmp_path / "ckpt"))
    assert manifest.world_size == 3 and manifest.step == 7
    assert manifest.totals["bytes_per_rank"] == written
    assert manifest.totals["tensor_bytes"] == 3000 * 4 + 3 * 8
    assert max(written) - min(written) <= 1024 + 256
    assert sorted(manifest.rank_local) == [0, 1, 2]
    assert ss.verify(str(tmp_path / "ckpt")).ok

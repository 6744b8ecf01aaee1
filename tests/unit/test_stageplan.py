"""Staging steps (pure) and the async save's batched runs on real files.

The steps decide once per plan which chunks share one batched copy; the saves check that the
runs they drive copy every dtype, layout and device case bitwise, save after save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.engine import staging
from snapstate.engine.stageplan import Run, Single, stage_steps
from snapstate.planning.items import RankPlan
from snapstate.planning.layout import plan_save
from snapstate.state.dtensor import item_meta
from support.bits import assert_bitwise_equal, bits
from support.states import blank_like
from support.tensors import random_tensor

MiB = 1 << 20


def rank_plan(state: dict[str, torch.Tensor], local: tuple[str, ...] = ()) -> RankPlan:
    metas = [item_meta(k, t, rank_local=k in local) for k, t in state.items()]
    return plan_save([metas]).for_rank(0)


def sizes_state() -> dict[str, torch.Tensor]:
    return {
        "a": torch.zeros(MiB // 4),  # 1 MiB
        "b": torch.zeros(3 * MiB // 4),  # 3 MiB
        "c": torch.zeros(10),
        "d": torch.zeros(20 * MiB // 4),  # 20 MiB: larger than the pieces below
        "e": torch.zeros(5, dtype=torch.int64),
    }


def test_runs_take_consecutive_chunks_that_fit_a_piece_and_singles_the_rest() -> None:
    plan = rank_plan(sizes_state())
    steps = stage_steps(plan, piece_bytes=8 * MiB, run_chunk_bytes=8 * MiB)
    placed = [p for f in plan.files for p in f.items]
    flat = [p for s in steps for p in (s.placed if isinstance(s, Run) else (s.placed,))]
    assert flat == placed  # every chunk once, in file order
    assert [p.item.key for s in steps if isinstance(s, Single) for p in (s.placed,)] == ["d"]
    for run in (s for s in steps if isinstance(s, Run)):
        base = run.placed[0].start
        assert run.layout.offsets == tuple(p.start - base for p in run.placed)
        assert run.layout.nbytes == run.placed[-1].end - base <= 8 * MiB
        assert run.keys == tuple(p.item.key for p in run.placed)
        assert [(b, e) for _, b, e, _ in run.parts] == [
            (p.start - base, p.end - base) for p in run.placed
        ]


def test_a_blocking_save_runs_only_small_chunks() -> None:
    plan = rank_plan(sizes_state())
    steps = stage_steps(plan, piece_bytes=8 * MiB, run_chunk_bytes=MiB)
    singles = {s.placed.item.key for s in steps if isinstance(s, Single)}
    assert singles == {"b", "d"}


def test_steps_are_built_once_per_plan_and_sizes() -> None:
    plan = rank_plan(sizes_state())
    assert stage_steps(plan, 8 * MiB, MiB) is stage_steps(plan, 8 * MiB, MiB)
    assert stage_steps(plan, 8 * MiB, MiB) is not stage_steps(plan, 8 * MiB, 8 * MiB)


def test_a_run_mixing_rank_local_chunks_takes_views_and_copies_bool_as_bytes() -> None:
    state = {
        "x": torch.zeros(4),
        "flags": torch.zeros(8, dtype=torch.bool),
        "u": torch.zeros(3, dtype=torch.uint32),  # numpy's RNG state is one
        "rl": torch.zeros(3),
    }
    steps = stage_steps(rank_plan(state, local=("rl",)), 8 * MiB, MiB)
    (run,) = steps
    assert isinstance(run, Run)
    assert run.keys is None  # two dicts: views are taken chunk by chunk
    assert run.batchable  # every dtype has a batched copy, as itself or as an integer
    retyped = {run.placed[i].item.key: run.layout.dtypes[i] for i in run.retyped}
    assert retyped == {"flags": torch.uint8, "u": torch.int32}


def test_split_cuts_a_run_into_spans_of_about_equal_bytes() -> None:
    state = {f"t{i}": torch.zeros(MiB // 4) for i in range(8)}
    (run,) = stage_steps(rank_plan(state), 64 * MiB, 64 * MiB)
    assert isinstance(run, Run)
    assert run.layout.split(2) == [0, 4, 8]
    assert run.layout.split(3) == [0, 3, 6, 8]
    assert run.layout.split(1) == [0, 8]


def mixed_state(seed: int) -> dict[str, torch.Tensor]:
    """Small chunks of every kind a run meets: dtypes, a bool, views, 0-d and empty tensors,
    and enough bytes that a run is copied on several threads."""
    big = random_tensor(torch.float32, (6 * MiB // 4,), seed=seed)
    wide = random_tensor(torch.float32, (64, 64), seed=seed + 1)
    state = {f"w{i}": random_tensor(torch.float32, (256, 256), seed=seed + i) for i in range(6)}
    state.update(
        big=big,
        half=random_tensor(torch.float16, (300, 7), seed=seed + 10),
        bf=random_tensor(torch.bfloat16, (33,), seed=seed + 11),
        flags=torch.arange(17) % (seed + 2) == 0,
        odd_bools=torch.tensor([2, 0, 7], dtype=torch.uint8).view(torch.bool),  # bytes kept
        u32=torch.arange(9, dtype=torch.int32).view(torch.uint32),
        ids=random_tensor(torch.int64, (5, 3), seed=seed + 13),
        step=torch.tensor(float(seed)),
        empty=torch.zeros(0, 4),
        strided=wide[:, ::2],
        tail=big[1:1025],  # a view at an offset into another tensor's storage
    )
    return state


def assert_holds(path: Path, expected: dict[str, torch.Tensor]) -> None:
    ss.verify(path)
    target = blank_like(expected)
    ss.load(target, path)
    for k, v in expected.items():
        assert_bitwise_equal(target[k], v)


def test_async_saves_of_a_cached_plan_stage_each_saves_values(tmp_path: Path) -> None:
    """The second and third saves reuse the plan, its steps and the slab's views."""
    pool = ss.HostBufferPool()
    for i in range(3):
        state = mixed_state(i)  # new tensors, same structure: the plan is reused
        expected = {k: bits(v).clone().view(v.dtype) for k, v in state.items()}  # bytes kept
        handle = ss.async_save(state, tmp_path / f"s{i}", pool=pool)
        for t in state.values():
            t.zero_()  # the training step right after the call
        result = handle.wait()
        assert result.timings["plan_cached"] == (1.0 if i else 0.0)
        assert_holds(tmp_path / f"s{i}", expected)


def test_a_failed_run_copy_gives_its_slab_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = ss.HostBufferPool(budget_bytes=16 * MiB, slab_bytes=8 * MiB)
    state = {f"t{i}": random_tensor(torch.float32, (64, 1024), seed=i) for i in range(4)}

    def failing(*_: object) -> None:
        raise MemoryError("injected")

    monkeypatch.setattr(staging, "copy_run", failing)
    with pytest.raises(MemoryError):
        ss.async_save(state, tmp_path / "bad", pool=pool)
    pool.seal()
    pool.clear()
    assert pool.allocated_bytes == 0  # a slab still counted as in use was leaked
    monkeypatch.undo()
    ss.async_save(state, tmp_path / "good", pool=pool).wait()
    assert_holds(tmp_path / "good", state)


def test_witnessed_chunks_are_packed_into_runs_aligned_to_their_itemsize() -> None:
    from snapstate.engine.stageplan import witness_steps

    state = {
        "a": torch.zeros(3, dtype=torch.int8),  # 3 bytes: the next chunk starts at 8
        "b": torch.zeros(2, dtype=torch.float64),
        "big": torch.zeros(3 * MiB // 4),  # 3 MiB: more than the pieces below
        "c": torch.zeros(5, dtype=torch.int16),
    }
    items = [p.item for f in rank_plan(state).files for p in f.items]
    by_key = {i.key: i for i in items}
    chosen = [by_key["a"], by_key["b"], by_key["big"], by_key["c"]]
    steps = witness_steps(chosen, piece_bytes=MiB)
    assert witness_steps(chosen, piece_bytes=MiB) is steps  # the same set again: kept
    kinds = [
        (type(s).__name__, [p.item.key for p in (s.placed if isinstance(s, Run) else (s.placed,))])
        for s in steps
    ]
    assert kinds == [("Single", ["big"]), ("Run", ["a", "b", "c"])]
    run = steps[1]
    assert isinstance(run, Run)
    assert run.layout.offsets == (0, 8, 24) and run.layout.nbytes == 34
    assert run.keys == ("a", "b", "c")

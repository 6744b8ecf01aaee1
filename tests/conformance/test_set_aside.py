"""A damaged latest step does not block the run, on every backend (issue 12.1): restore falls
back, sets the damaged step aside, and training saves that step again; latest_step() and
retention ignore the set-aside bytes, which are kept for inspection."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import snapstate as ss
from snapstate.storage.base import Storage
from support.states import assert_same_state, training_state

from .conftest import Backend


def _first_shard(step: Storage) -> str:
    return ss.inspect(step).tensors["model/0.weight"].chunks[0].file


def truncated_shard(step: Storage) -> None:
    name = _first_shard(step)
    step.write_atomic(name, step.read_bytes(name)[:-64])


def zero_filled_shard(step: Storage) -> None:
    name = _first_shard(step)
    step.write_atomic(name, bytes(step.size(name)))


def missing_shard(step: Storage) -> None:
    step.remove(_first_shard(step))


def truncated_manifest(step: Storage) -> None:
    step.write_atomic("manifest.json", step.read_bytes("manifest.json")[:100])


def zero_filled_manifest(step: Storage) -> None:
    step.write_atomic("manifest.json", bytes(step.size("manifest.json")))


DAMAGE = [
    truncated_shard,
    zero_filled_shard,
    missing_shard,
    truncated_manifest,
    zero_filled_manifest,
]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_step_is_set_aside_and_training_continues(
    backend: Backend, damage: Callable[[Storage], None]
) -> None:
    with ss.CheckpointManager(backend.target("run"), keep_last=2, async_save=False) as mgr:
        mgr.save(1, training_state(seed=1))
        mgr.save(2, training_state(seed=2))
    damage(backend.storage("run").child("step-000000002"))
    with ss.CheckpointManager(backend.target("run"), keep_last=2, async_save=False) as mgr:
        restored = training_state(seed=9)
        assert mgr.restore(restored) == 1
        assert_same_state(training_state(seed=1), restored)
        assert 2 in mgr.corrupt_steps
        assert mgr.latest_step() == 1 and mgr.steps() == [1]
        mgr.save(2, training_state(seed=22))  # the loop's next save: no CheckpointExistsError
        mgr.save(3, training_state(seed=3))
        assert mgr.steps() == [2, 3]  # retention counted only real checkpoints
    with ss.CheckpointManager(backend.target("run"), async_save=False) as mgr:
        restored = training_state(seed=9)
        assert mgr.restore(restored) == 3
        assert_same_state(training_state(seed=3), restored)
    names = backend.storage("run").listdir()
    kept = [n for n in names if n.endswith(".corrupt")] or [
        n for n in names if backend.storage("run").exists(f"{n}/manifest.json.corrupt")
    ]
    assert kept, f"the damaged step's bytes are kept for inspection: {names}"


def test_an_incompatible_state_is_not_set_aside(backend: Backend) -> None:
    """A step that does not fit the caller's state is not damaged: it stays in the run."""
    with ss.CheckpointManager(backend.target("run"), async_save=False) as mgr:
        mgr.save(1, training_state(seed=1))
    with ss.CheckpointManager(backend.target("run"), async_save=False) as mgr:
        assert mgr.restore({"other": training_state(seed=1)["model"]}) is None
        assert mgr.steps() == [1]

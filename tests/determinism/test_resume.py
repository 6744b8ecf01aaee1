"""A run SIGKILLed mid-epoch and resumed in a new process is bitwise identical to an uninterrupted one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from support.bits import tree_differences

from .resume_harness import (
    KillResume,
    Spec,
    kill_and_resume,
    loss_mismatches,
    resume_copy,
    stitched,
)

SPEC = Spec(steps=30, every=5, kill_at=18)  # checkpoints at 5, 10, 15; killed at 18, mid-epoch 2


def _kill_and_resume(workers: int, factory: pytest.TempPathFactory) -> KillResume:
    spec = replace(SPEC, workers=workers)
    return kill_and_resume(factory.mktemp(f"resume-w{workers}"), spec)


@pytest.fixture(scope="module")
def runs_in_process(tmp_path_factory: pytest.TempPathFactory) -> KillResume:
    """Runs whose data loader works in the training process (num_workers=0)."""
    return _kill_and_resume(0, tmp_path_factory)


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "workers2"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> KillResume:
    if request.param == 0:
        return request.getfixturevalue("runs_in_process")
    return _kill_and_resume(request.param, tmp_path_factory)


def test_kill_landed_mid_epoch_after_a_committed_checkpoint(runs: KillResume) -> None:
    assert runs.checkpoint_step == 15
    assert max(runs.killed.losses) == SPEC.kill_at  # it trained past the checkpoint before dying
    assert min(runs.resumed.losses) == 16  # resumed from the manager's latest step
    assert not (runs.killed.out / "final.pt").exists()


def test_losses_are_bitwise_identical(runs: KillResume) -> None:
    want = runs.reference.losses
    assert sorted(want) == list(range(1, SPEC.steps + 1))
    assert loss_mismatches(want, stitched(runs.killed, runs.resumed, runs.checkpoint_step)) == []
    # The steps the killed run did after its checkpoint were redone identically too.
    assert loss_mismatches({s: want[s] for s in runs.killed.losses}, runs.killed.losses) == []


def test_final_parameters_and_optimizer_state_are_bitwise_identical(runs: KillResume) -> None:
    a, b = runs.reference.final(), runs.resumed.final()
    assert a["step"] == b["step"] == SPEC.steps
    assert a["optim"]["state"], "Adam state must exist to be compared"
    for part in ("model", "optim", "sched", "rng"):
        assert tree_differences(a[part], b[part], part) == []


@pytest.mark.parametrize("skip", ["rng", "loader"])
def test_resume_without_part_of_the_state_diverges(
    skip: str, tmp_path: Path, runs_in_process: KillResume
) -> None:
    """Negative control: the comparison does catch a resume that is not exact."""
    runs = runs_in_process
    partial = resume_copy(
        SPEC, runs.killed, tmp_path / f"without-{skip}", ["--skip", skip, "--no-save"]
    )
    want = runs.reference.losses
    assert sorted(partial.losses) == list(range(16, SPEC.steps + 1))  # it did resume from step 15
    after = loss_mismatches({s: want[s] for s in range(16, SPEC.steps + 1)}, partial.losses)
    assert len(after) >= 10, f"resume without {skip} should diverge from step 16 on: {after}"
    a, b = runs.reference.final(), partial.final()
    assert tree_differences(a["model"], b["model"], "model") != []


def test_shared_generator_without_epoch_reseed_resumes_bitwise_past_the_next_epoch(
    tmp_path: Path,
) -> None:
    """The loader's generator is never reseeded: the epochs after the resumed one match too.

    torchdata alone restores the generator to the start of the epoch and replays only the
    permutation, not the ``_base_seed`` draw; snapstate saves the generator's current state
    and sets it after creating the resumed iterator (state/loaders.py).
    """
    runs = kill_and_resume(tmp_path, replace(SPEC, reseed=False))
    want, got = runs.reference.losses, stitched(runs.killed, runs.resumed, runs.checkpoint_step)
    assert sorted(got) == list(range(1, SPEC.steps + 1))
    assert loss_mismatches(want, got) == []  # step 25 is the first batch of epoch 3

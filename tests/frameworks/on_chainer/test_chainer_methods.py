"""The harness's Chainer methods on its ChainerMN trainer: each restores what it saved.

Chainer's snapshot and ChainerMN's checkpointer keep the updater (model, optimizer, iterator
position) but not numpy's generator, which the flips draw from; snapstate keeps it too, so
only its resumed steps equal the uninterrupted ones. The checkpointer needs MPI: it runs in
the 2-rank harness test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from support.methods import load_with, save_after_steps

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("chainer") is None, reason="needs chainer: make test-frameworks"
)

METHODS = ["chainer-snapshot", "snapstate-chainer", "snapstate-chainer-async"]


def _trainer() -> Any:
    from snapstate.bench.chainer_train import ChainerTrainer
    from snapstate.bench.train import TrainConfig

    return ChainerTrainer(TrainConfig("resnet18:w=0.125", batch=8, samples=64), 0, 1)


def _optimizer_arrays(trainer: Any) -> dict[str, bytes]:
    from snapstate.integrations.chainer import named_arrays

    return {k: v.tobytes() for k, v in named_arrays(trainer.optimizer, copy=False).items()}


@pytest.mark.parametrize("name", METHODS)
def test_load_restores_model_optimizer_and_position(name: str, tmp_path: Path) -> None:
    a = _trainer()
    save_after_steps(a, name, tmp_path / "step-3")
    saved = {k: v.tobytes() for k, v in a.final_params().items()}
    saved_opt = _optimizer_arrays(a)
    later = [a.train_step() for _ in range(2)]

    b = _trainer()
    load_with(name, b, tmp_path / "step-3")
    assert {k: v.tobytes() for k, v in b.final_params().items()} == saved
    assert _optimizer_arrays(b) == saved_opt
    assert (b.step, b.epoch, b.position) == (3, 0, 3)
    resumed = [b.train_step() for _ in range(2)]
    if name.startswith("snapstate"):
        assert resumed == later
    else:
        assert resumed != later  # the flips start again from numpy's seed

"""The harness's TensorFlow methods on its Keras trainer: each restores what it saved.

tf.train.Checkpoint, Keras ModelCheckpoint and snapstate all bring back the model and the
optimizer bit for bit; only snapstate also brings back the data position and tf.random's
generator, so only its resumed steps equal the uninterrupted ones.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.methods import load_with, save_after_steps

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow: make test-frameworks"
)

TF_METHODS = [
    "tf-checkpoint",
    "tf-checkpoint-async",
    "keras-modelcheckpoint",
    "snapstate-tf",
    "snapstate-tf-async",
]


def _trainer() -> Any:
    from snapstate.bench.tf_train import KerasTrainer
    from snapstate.bench.train import TrainConfig

    # 64 samples, batch 8: 8 batches an epoch, so the save at step 3 is mid-epoch
    return KerasTrainer(TrainConfig("resnet18:w=0.125", batch=8, samples=64), 0, 1)


def _arrays(variables: list[Any]) -> list[bytes]:
    return [np.array(v.numpy()).tobytes() for v in variables]


@pytest.mark.parametrize("name", TF_METHODS)
def test_load_restores_model_optimizer_and_step(name: str, tmp_path: Path) -> None:
    a = _trainer()
    save_after_steps(a, name, tmp_path / "step-3")
    saved_model, saved_opt = _arrays(a.model.variables), _arrays(a.optimizer.variables)
    later = [a.train_step() for _ in range(2)]

    b = _trainer()
    load_with(name, b, tmp_path / "step-3")
    assert _arrays(b.model.variables) == saved_model
    assert _arrays(b.optimizer.variables) == saved_opt
    assert (b.step, b.epoch) == (3, 0)
    resumed = [b.train_step() for _ in range(2)]
    if name.startswith("snapstate"):
        assert b.position == 5 and resumed == later  # same batches, same flips
    else:
        assert resumed != later  # the documented recipes restart the epoch and the RNG


@pytest.mark.parametrize("name", ["tf-checkpoint", "tf-checkpoint-async", "snapstate-tf-async"])
def test_repeated_saves(name: str, tmp_path: Path) -> None:
    """Several saves in one run, as the harness makes them, each loadable."""
    from snapstate.bench.methods import get_method

    a = _trainer()
    method = get_method(name)(0, 1)
    for step in (1, 2, 3):
        a.train_step()
        method.save(a, tmp_path / f"step-{step}")
    method.close()
    b = _trainer()
    get_method(name)(0, 1).load(b, tmp_path / "step-3")
    assert b.step == 3 and _arrays(b.model.variables) == _arrays(a.model.variables)

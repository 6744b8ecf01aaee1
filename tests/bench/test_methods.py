"""Each method's save and load in one process, the registry, and who-wrote-what attribution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from snapstate.bench.measure import walk_files
from snapstate.bench.methods import METHODS, Method, MethodInfo, Pending, get_method, register
from snapstate.bench.train import TrainConfig, Trainer

# torchdata's deprecated set_vital call, and DCP's note that it runs without a process group.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def small_trainer() -> Trainer:
    return Trainer(TrainConfig(model="resnet18:w=0.0625", batch=4, samples=64), rank=0, world=1)


TORCH_METHODS = [n for n, cls in METHODS.items() if cls.info.framework == "torch"]


# TensorFlow's and Chainer's methods: tests/frameworks, in their environments.
@pytest.mark.parametrize("name", TORCH_METHODS)
def test_load_restores_what_save_saw(tmp_path: Path, name: str) -> None:
    reason = get_method(name).unavailable(1)
    if reason:
        pytest.skip(reason)
    trainer = small_trainer()
    trainer.train_step()
    trainer.train_step()
    saved = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    method = get_method(name)(0, 1)
    pending = method.save(trainer, tmp_path / "ckpt")
    method.wait()
    assert pending.finished is not None and pending.save_s >= 0
    trainer.train_step()
    method.load(trainer, tmp_path / "ckpt")
    assert trainer.step == 2
    for key, value in trainer.module.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert {method.owner(rel) for rel, _ in walk_files(tmp_path / "ckpt")} == {0}
    method.close()


def test_owner_attributes_files_to_ranks() -> None:
    assert get_method("torch-allranks")(0, 4).owner("rank00003.pt") == 3
    assert get_method("torch-rank0")(0, 4).owner("checkpoint.pt") == 0
    dcp = METHODS["dcp"].__new__(METHODS["dcp"])
    assert dcp.owner("__2_0.distcp") == 2 and dcp.owner(".metadata") == 0
    snap = METHODS["snapstate"].__new__(METHODS["snapstate"])
    assert snap.owner("shards/r00002-000.safetensors") == 2 and snap.owner("manifest.json") == 0


def test_registry_is_open_for_other_frameworks() -> None:
    @register
    class Fake(Method):
        info = MethodInfo("fake-chainer", "chainer", "npz", ("model",), False, "rank 0", "n/a")

        def _start(self, trainer: Trainer, path: Path, pending: Pending) -> None:
            pending.finish()

        def load(self, trainer: Trainer, path: Path) -> None:
            pass

    try:
        assert get_method("fake-chainer") is Fake
        assert Fake(0, 1).describe()["framework"] == "chainer"
    finally:
        del METHODS["fake-chainer"]
    with pytest.raises(ValueError, match="known"):
        get_method("fake-chainer")


def test_pending_reports_background_errors() -> None:
    p = Pending(0.0)
    p.finish(OSError("disk full"))
    with pytest.raises(RuntimeError, match="disk full"):
        p.wait(1)

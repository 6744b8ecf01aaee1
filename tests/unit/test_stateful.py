"""Stateful objects round-trip: modules, optimizers, schedulers, scaler, data loader, RNG."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import snapstate as ss
from support.bits import assert_bitwise_equal, assert_tree_equal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_module_round_trip_includes_buffers(tmp_path: Path) -> None:
    model = make_model(0)
    model.train()
    model(torch.randn(8, 4))  # moves BatchNorm running stats and num_batches_tracked
    ss.save({"model": model}, tmp_path / "c")
    fresh = make_model(1)
    ss.load({"model": fresh}, tmp_path / "c")
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert_bitwise_equal(b, a), name


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    ],
    ids=["adam", "sgd_momentum", "adamw_amsgrad"],
)
def test_optimizer_loads_into_a_fresh_optimizer_and_training_continues_identically(
    tmp_path: Path, make_opt
) -> None:
    model = make_model(0)
    opt = make_opt(model.parameters())
    train_steps(model, opt, 3, seed=1)
    ss.save({"model": model, "optim": opt}, tmp_path / "c")
    expected = train_steps(model, opt, 3, seed=2)

    fresh_model = make_model(5)
    fresh_opt = make_opt(fresh_model.parameters())
    assert not fresh_opt.state  # lazily created state: nothing to fill in place
    ss.load({"model": fresh_model, "optim": fresh_opt}, tmp_path / "c")
    assert len(fresh_opt.state) == len(list(fresh_model.parameters()))
    assert train_steps(fresh_model, fresh_opt, 3, seed=2) == expected
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert_bitwise_equal(b, a)


def test_optimizer_param_groups_restored(tmp_path: Path) -> None:
    model = make_model(0)
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.5}, {"params": model[3].parameters()}],
        lr=0.1,
        momentum=0.9,
    )
    train_steps(model, opt, 1, seed=0)
    opt.param_groups[1]["lr"] = 0.025
    ss.save({"optim": opt}, tmp_path / "c")
    fresh = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 9.0}, {"params": model[3].parameters()}],
        lr=9.0,
        momentum=0.9,
    )
    ss.load({"optim": fresh}, tmp_path / "c")
    assert [g["lr"] for g in fresh.param_groups] == [0.5, 0.025]
    assert_tree_equal(fresh.state_dict(), opt.state_dict())


def test_lr_scheduler_round_trip(tmp_path: Path) -> None:
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=50)
    for _ in range(7):
        opt.step()
        sched.step()
    ss.save({"optim": opt, "sched": sched}, tmp_path / "c")
    expected = []
    for _ in range(5):
        opt.step()
        sched.step()
        expected.append(sched.get_last_lr())

    opt2 = torch.optim.SGD(model.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=1.0, total_steps=50)
    ss.load({"optim": opt2, "sched": sched2}, tmp_path / "c")
    assert sched2.last_epoch == 7
    got = []
    for _ in range(5):
        opt2.step()
        sched2.step()
        got.append(sched2.get_last_lr())
    assert got == expected


def test_grad_scaler_round_trip(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        loss = model(torch.randn(8, 4)).sum()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    saved = scaler.state_dict()
    ss.save({"scaler": scaler}, tmp_path / "c")
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0, growth_interval=99)
    ss.load({"scaler": fresh}, tmp_path / "c")
    assert fresh.state_dict() == saved
    assert fresh.get_scale() == scaler.get_scale() == 2048.0


def make_loader(seed: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.arange(50).float().unsqueeze(1)
    return StatefulDataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


def test_stateful_dataloader_resumes_mid_epoch(tmp_path: Path) -> None:
    loader = make_loader(seed=3)
    it = iter(loader)
    for _ in range(5):
        next(it)
    ss.save({"loader": loader}, tmp_path / "c")
    remaining = [b.clone() for b in it]

    fresh = make_loader(seed=999)
    ss.load({"loader": fresh}, tmp_path / "c")
    resumed = list(fresh)
    assert len(resumed) == len(remaining) == 13 - 5
    for a, b in zip(resumed, remaining):
        assert torch.equal(a, b)


def test_rng_state_restores_python_numpy_and_torch(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1), np.random.randn()  # gauss caches
    ss.save({"rng": ss.RNGState()}, tmp_path / "c")
    expected = (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(),
        torch.rand(4).tolist(),
    )

    random.seed(100)
    np.random.seed(100)
    torch.manual_seed(100)
    ss.load({"rng": ss.RNGState()}, tmp_path / "c")
    got = (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(),
        torch.rand(4).tolist(),
    )
    assert got == expected


def test_rng_state_is_rank_local(tmp_path: Path) -> None:
    ss.save({"rng": ss.RNGState()}, tmp_path / "c")
    manifest = ss.inspect(tmp_path / "c")
    assert not manifest.tensors and 0 in manifest.rank_local
    assert "rng" in manifest.rank_local[0].trees


def test_rank_local_round_trip(tmp_path: Path) -> None:
    state = {
        "local": ss.RankLocal({"seen": 10, "buf": torch.arange(5), "arr": np.ones(3)}),
        "g": torch.ones(2),
    }
    ss.save(state, tmp_path / "c")
    manifest = ss.inspect(tmp_path / "c")
    assert manifest.rank_local[0].tensors["local/value/buf"].placement == "rank_local"
    target = ss.RankLocal(None)
    ss.load({"local": target, "g": torch.zeros(2)}, tmp_path / "c")
    assert_tree_equal(target.value, state["local"].value)


def test_rank_local_skip_leaves_it_untouched(tmp_path: Path) -> None:
    ss.save({"local": ss.RankLocal({"seen": 10}), "g": torch.ones(2)}, tmp_path / "c")
    target = ss.RankLocal({"seen": 0})
    g = torch.zeros(2)
    ss.load({"local": target, "g": g}, tmp_path / "c", rank_local="skip")
    assert target.value == {"seen": 0} and torch.equal(g, torch.ones(2))


def test_full_training_state(tmp_path: Path) -> None:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    train_steps(model, opt, 2, seed=0)
    sched.step()
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "rng": ss.RNGState(),
        "epoch": 3,
        "loader": make_loader(1),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ss.save(state, tmp_path / "c")
    model2 = make_model(7)
    opt2 = torch.optim.Adam(model2.parameters())
    fresh = {
        "model": model2,
        "optim": opt2,
        "sched": torch.optim.lr_scheduler.StepLR(opt2, 2),
        "rng": ss.RNGState(),
        "epoch": 0,
        "loader": make_loader(2),
    }
    result = ss.load(fresh, tmp_path / "c")
    assert fresh["epoch"] == 3 and fresh["sched"].last_epoch == 1
    assert not result.skipped.missing and not result.skipped.mismatched
    assert_tree_equal(opt2.state_dict(), opt.state_dict())

"""Chainer adapter: bitwise round trips, async save, refusals, and bitwise resume on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import snapstate as ss
from snapstate.integrations.chainer import stateful

try:
    import chainer
except ImportError:  # the core venv: collected, skipped; `make test-frameworks` runs them
    chainer = None  # type: ignore[assignment]
F: Any = chainer.functions if chainer is not None else None
L: Any = chainer.links if chainer is not None else None
pytestmark = pytest.mark.skipif(chainer is None, reason="needs Chainer: make test-frameworks")


class _Net(chainer.Chain if chainer is not None else object):  # type: ignore[misc]
    def __init__(self, width: int) -> None:
        super().__init__()
        with self.init_scope():
            self.fc1 = L.Linear(8, width)
            self.bn = L.BatchNormalization(width)
            self.fc2 = L.Linear(width, 4)

    def forward(self, x: Any) -> Any:
        # dropout draws from numpy's global generator on CPU
        return self.fc2(F.dropout(F.relu(self.bn(self.fc1(x))), 0.3))


def _setup(seed: int, width: int = 16) -> tuple[Any, Any]:
    np.random.seed(seed)
    net = _Net(width)
    opt = chainer.optimizers.Adam(alpha=1e-2)
    opt.setup(net)
    return net, opt


def _train(net: Any, opt: Any, steps: range) -> None:
    for step in steps:
        # data depends only on the step index, so a resumed run sees the same batches
        data = np.random.default_rng(step).standard_normal((32, 12)).astype(np.float32)
        loss = F.mean_squared_error(net(data[:, :8]), data[:, 8:])
        net.cleargrads()
        loss.backward()
        opt.update()


def _bits(state: Any) -> dict[str, bytes]:
    sd = state.state_dict()
    out = {
        f"{p}/{k}": np.ascontiguousarray(v).tobytes()
        for p in ("model", "optimizer")
        for k, v in sd[p].items()
    }
    rng = getattr(sd["rng"], "value", sd["rng"])  # the generator is RankLocal
    out["rng"] = np.asarray(rng["keys"]).tobytes() + bytes([rng["pos"] % 256])
    return out


def test_round_trip_is_bitwise(tmp_path: Path) -> None:
    net, opt = _setup(1)
    _train(net, opt, range(3))
    saved = stateful(net, opt)
    ss.save({"train": saved}, tmp_path / "ck")
    expected = _bits(saved)
    fresh_net, fresh_opt = _setup(2)
    fresh = stateful(fresh_net, fresh_opt)
    ss.load({"train": fresh}, tmp_path / "ck")
    assert _bits(fresh) == expected
    assert fresh_opt.t == 3


def test_async_save_keeps_the_values_of_the_call(tmp_path: Path) -> None:
    net, opt = _setup(3)
    _train(net, opt, range(2))
    state = stateful(net, opt)
    before = _bits(state)
    handle = ss.async_save({"train": state}, tmp_path / "ck")
    _train(net, opt, range(2, 4))  # changes the arrays while the save may still be writing
    handle.wait()
    fresh = stateful(*_setup(4))
    ss.load({"train": fresh}, tmp_path / "ck")
    assert _bits(fresh) == before


def test_wrong_shapes_are_refused_and_leave_the_state_untouched(tmp_path: Path) -> None:
    net, opt = _setup(5)
    _train(net, opt, range(1))
    ss.save({"train": stateful(net, opt)}, tmp_path / "ck")
    other = stateful(*_setup(6, width=32))
    before = _bits(other)
    with pytest.raises(ss.IncompatibleStateError) as info:
        ss.load({"train": other}, tmp_path / "ck")
    assert "fc1.W" in str(info.value) and "shape" in str(info.value)
    assert _bits(other) == before


def test_resume_equals_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    net, opt = _setup(7)
    _train(net, opt, range(6))
    straight = _bits(stateful(net, opt))

    net, opt = _setup(7)
    _train(net, opt, range(3))
    ss.save({"train": stateful(net, opt)}, tmp_path / "ck")
    _train(net, opt, range(100, 103))  # the interrupted run goes on before it dies

    net, opt = _setup(8)
    resumed = stateful(net, opt)
    ss.load({"train": resumed}, tmp_path / "ck")
    _train(net, opt, range(3, 6))
    assert _bits(resumed) == straight

"""TensorFlow adapter: bitwise round trips, async save, refusals, and bitwise resume on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import snapstate as ss
from snapstate.integrations.tensorflow import stateful

try:
    import tensorflow as tf
except ImportError:  # the core venv: collected, skipped; `make test-frameworks` runs them
    tf = None  # type: ignore[assignment]
keras: Any = tf.keras if tf is not None else None
pytestmark = pytest.mark.skipif(tf is None, reason="needs TensorFlow: make test-frameworks")


def _model(seed: int, width: int = 16) -> Any:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dropout(0.3, seed=seed),
            keras.layers.Dense(4),
        ]
    )
    return model


def _train(model: Any, opt: Any, steps: range) -> None:
    loss_fn = keras.losses.MeanSquaredError()
    for step in steps:
        # data depends only on the step index, so a resumed run sees the same batches
        data = np.random.default_rng(step).standard_normal((32, 12)).astype(np.float32)
        with tf.GradientTape() as tape:
            noise = tf.random.get_global_generator().normal((32, 4)) * 0.01
            loss = loss_fn(data[:, 8:] + noise, model(data[:, :8], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))


def _bits(state: Any) -> dict[str, bytes]:
    return {
        f"{part}/{k}": np.ascontiguousarray(v).tobytes()
        for part, arrays in state.state_dict().items()
        for k, v in getattr(arrays, "value", arrays).items()  # the generator is RankLocal
    }


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    tf.config.experimental.enable_op_determinism()
    # with op determinism on, tf refuses to create the global generator implicitly
    tf.random.set_global_generator(tf.random.Generator.from_seed(0))


def test_round_trip_is_bitwise(tmp_path: Path) -> None:
    model, opt = _model(1), keras.optimizers.Adam(1e-2)
    _train(model, opt, range(3))
    saved = stateful(model, opt)
    ss.save({"train": saved}, tmp_path / "ck")
    fresh_model, fresh_opt = _model(2), keras.optimizers.Adam(1e-2)
    fresh = stateful(fresh_model, fresh_opt)
    assert _bits(fresh) != _bits(saved)
    ss.load({"train": fresh}, tmp_path / "ck")
    assert _bits(fresh) == _bits(saved)
    assert int(fresh_opt.iterations.numpy()) == 3


def test_async_save_keeps_the_values_of_the_call(tmp_path: Path) -> None:
    model, opt = _model(3), keras.optimizers.SGD(1e-2, momentum=0.9)
    _train(model, opt, range(2))
    state = stateful(model, opt)
    before = _bits(state)
    handle = ss.async_save({"train": state}, tmp_path / "ck")
    _train(model, opt, range(2, 4))  # changes the variables while the save may still be writing
    handle.wait()
    fresh = stateful(_model(4), keras.optimizers.SGD(1e-2, momentum=0.9))
    ss.load({"train": fresh}, tmp_path / "ck")
    assert _bits(fresh) == before


def test_wrong_shapes_are_refused_and_leave_the_state_untouched(tmp_path: Path) -> None:
    model, opt = _model(5), keras.optimizers.Adam()
    _train(model, opt, range(1))
    ss.save({"train": stateful(model, opt)}, tmp_path / "ck")
    other = stateful(_model(6, width=32), keras.optimizers.Adam())
    before = _bits(other)
    with pytest.raises(ss.IncompatibleStateError) as info:
        ss.load({"train": other}, tmp_path / "ck")
    assert "kernel" in str(info.value) and "shape" in str(info.value)
    assert _bits(other) == before


def test_resume_equals_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    tf.random.set_global_generator(tf.random.Generator.from_seed(7))
    model, opt = _model(7), keras.optimizers.Adam(1e-2)
    _train(model, opt, range(6))
    straight = _bits(stateful(model, opt))

    tf.random.set_global_generator(tf.random.Generator.from_seed(7))
    model, opt = _model(7), keras.optimizers.Adam(1e-2)
    _train(model, opt, range(3))
    ss.save({"train": stateful(model, opt)}, tmp_path / "ck")
    _train(model, opt, range(100, 103))  # the interrupted run goes on before it dies

    tf.random.set_global_generator(tf.random.Generator.from_seed(99))
    model, opt = _model(8), keras.optimizers.Adam(1e-2)
    resumed = stateful(model, opt)
    ss.load({"train": resumed}, tmp_path / "ck")
    _train(model, opt, range(3, 6))
    assert _bits(resumed) == straight

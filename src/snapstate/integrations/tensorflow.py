"""TensorFlow/Keras as a Stateful: model and optimizer variables and tf's global generator.

Under ``MultiWorkerMirroredStrategy`` the trainable weights and the optimizer's slots are
replicas (written once, a share per worker). Keras updates non-trainable variables (BatchNorm
statistics, dropout seed states) on each worker on its own and the strategy never syncs them:
rank 0's copy is written, as TensorFlow's chief-only checkpoint keeps it. The global generator
is per worker (``ss.RankLocal``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from snapstate.integrations._check import mismatches, raise_if_any
from snapstate.state.stateful import RankLocal


def _by_name(variables: list[Any]) -> dict[str, Any]:
    # Keras numbers auto-named layers per process ("dense_3"), so a fresh model of the same
    # architecture gets other paths: keys are the variable's position plus its short name.
    out: dict[str, Any] = {}
    for i, var in enumerate(variables):
        short = str(var.name).rsplit("/", 1)[-1].split(":")[0].rsplit("_", 1)[-1]
        out[f"{i:04d}_{short}"] = var
    return out


class TFState:
    """Model, optimizer and ``tf.random`` global generator state of one TensorFlow worker."""

    def __init__(self, model: Any, optimizer: Any = None, rng: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.rng = rng

    def _optimizer_vars(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        if not getattr(self.optimizer, "built", True):
            # Keras builds slots lazily at the first step; a fresh optimizer must have them to load.
            self.optimizer.build(self.model.trainable_variables)
        return _by_name(list(self.optimizer.variables))

    def _parts(self) -> dict[str, dict[str, Any]]:
        parts = {"model": _by_name(list(self.model.variables))}
        if self.optimizer is not None:
            parts["optimizer"] = self._optimizer_vars()
        if self.rng:
            import tensorflow as tf

            parts["rng"] = {"global_generator": tf.random.get_global_generator().state}
        return parts

    def divergent_replica_keys(self) -> list[tuple[str, str]]:
        """Non-trainable model variables: each worker updates its own (see the module doc)."""
        trainable = {id(v) for v in self.model.trainable_variables}
        named = _by_name(list(self.model.variables))
        return [("model", key) for key, var in named.items() if id(var) not in trainable]

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            part: {k: np.array(v.numpy(), copy=True) for k, v in variables.items()}
            for part, variables in self._parts().items()
        }
        if "rng" in out:
            out["rng"] = RankLocal(out["rng"])
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = self._parts()
        got = {p: _unwrap(state_dict.get(p, {})) for p in parts}
        found = [m for p in parts for m in mismatches(p, parts[p], got[p])]
        raise_if_any("TensorFlow state", found)
        for part, variables in parts.items():
            for key, var in variables.items():
                var.assign(np.asarray(got[part][key]))


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, RankLocal) else value


def stateful(model: Any, optimizer: Any = None, rng: bool = True) -> TFState:
    """``ss.save({"train": stateful(model, opt)}, path)``: a Keras model (and optimizer) as Stateful."""
    return TFState(model, optimizer, rng)

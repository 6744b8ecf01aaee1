"""Chainer as a Stateful: link and optimizer through chainer's own serializers, numpy's RNG.

Under ChainerMN the parameters and optimizer state are replicas (written once, a share per
rank). A link's persistent values (BatchNorm statistics) are updated by each rank on its own
and never all-reduced: rank 0's copy is written. numpy's generator is per rank (``ss.RankLocal``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from snapstate.integrations._check import mismatches, raise_if_any
from snapstate.state.stateful import RankLocal


def named_arrays(obj: Any, copy: bool = True) -> dict[str, Any]:
    """Every array Chainer's serializers would save of a link or optimizer, by dotted name."""
    from chainer.serializers.npz import DictionarySerializer

    ser = DictionarySerializer()
    ser.save(obj)
    # None entries (e.g. an uninitialized parameter) are object arrays: nothing to keep.
    # "/" would be escaped in checkpoint keys ("fc1%2FW"): dots read better in errors.
    return {
        k.strip("/").replace("/", "."): np.array(v, copy=True) if copy else np.asarray(v)
        for k, v in ser.target.items()
        if v.dtype != object
    }


def _deserialize(obj: Any, arrays: dict[str, Any]) -> None:
    from chainer.serializers.npz import NpzDeserializer

    NpzDeserializer({k.replace(".", "/"): np.asarray(v) for k, v in arrays.items()}).load(obj)


def _numpy_rng() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "keys": np.asarray(keys).copy(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def _set_numpy_rng(state: dict[str, Any]) -> None:
    keys = np.asarray(state["keys"], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, state["pos"], state["has_gauss"], state["gauss"]))


class ChainerState:
    """A link, its optimizer and numpy's global generator (Chainer's CPU randomness)."""

    def __init__(self, link: Any, optimizer: Any = None, rng: bool = True) -> None:
        self.link = link
        self.optimizer = optimizer
        self.rng = rng

    def divergent_replica_keys(self) -> list[tuple[str, str]]:
        """Persistent values of every link: each rank updates its own (see the module doc)."""
        saved = named_arrays(self.link, copy=False)
        keys = []
        for name, link in self.link.namedlinks():
            for persistent in sorted(link._persistent):
                key = f"{name}/{persistent}".strip("/").replace("/", ".")
                if key in saved:
                    keys.append(("model", key))
        return keys

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": named_arrays(self.link)}
        if self.optimizer is not None:
            out["optimizer"] = named_arrays(self.optimizer)
        if self.rng:
            out["rng"] = RankLocal(_numpy_rng())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Views, not copies: only names, shapes and dtypes are compared.
        found = mismatches("model", named_arrays(self.link, False), state_dict.get("model", {}))
        if self.optimizer is not None:
            # Optimizer slots appear at the first update: a fresh optimizer lacks them.
            got = state_dict.get("optimizer", {})
            found += mismatches(
                "optimizer", named_arrays(self.optimizer, False), got, extra_ok=True
            )
        raise_if_any("Chainer state", found)
        _deserialize(self.link, state_dict["model"])
        if self.optimizer is not None:
            _deserialize(self.optimizer, state_dict["optimizer"])
        rng = state_dict.get("rng")
        if self.rng and rng is not None:
            _set_numpy_rng(rng.value if isinstance(rng, RankLocal) else rng)


def stateful(link: Any, optimizer: Any = None, rng: bool = True) -> ChainerState:
    """``ss.save({"train": stateful(link, opt)}, path)``: a Chainer link (and optimizer) as Stateful."""
    return ChainerState(link, optimizer, rng)

"""Stateful objects and rank-local wrappers: what a state tree may contain besides leaves."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(d)``: modules, optimizers, loaders..."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


_PLAIN = (bool, int, float, str, bytes, type(None), dict, list, tuple)


def is_stateful(obj: Any) -> bool:
    # Same answer as isinstance(obj, Stateful), which is slow (it walks the Protocol's members)
    # and runs for every node of a state tree. Classes (not instances) must not be called.
    if type(obj) in _PLAIN or isinstance(obj, type):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class RankLocal:
    """Per-rank state: written by its own rank and restored to the same rank.

    ``ss.RankLocal({"seen": 10})`` wraps plain values; it is itself Stateful so that
    loading replaces the wrapped value in place.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]

    def __repr__(self) -> str:
        return f"RankLocal({self.value!r})"

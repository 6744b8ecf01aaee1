"""State trees <-> flat key paths: Stateful objects become state dicts, leaves become items.

The structure of the tree is kept as a small JSON "node" (see ``format/SPEC.md``) so that a
load can rebuild containers the target does not have yet (a fresh optimizer's ``state``),
restore int keys and tuples, and replace plain values. Nothing is pickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from snapstate.errors import NestingLimitError
from snapstate.format.tree import MAX_TREE_DEPTH
from snapstate.state.loaders import is_loader, is_rank_local_sampler, state_of
from snapstate.state.rng import RNGState
from snapstate.state.stateful import RankLocal, is_stateful
from snapstate.state.typed import TYPED_BASES, atom_payload, container_parts

Node = dict[str, Any]

_JSON_SCALARS = (bool, int, str, type(None))


def escape_component(key: str | int) -> str:
    """One path component: '/' and '%' are escaped so paths split unambiguously."""
    return str(key).replace("%", "%25").replace("/", "%2F")


def join_key(prefix: str, key: str | int) -> str:
    component = escape_component(key)
    return f"{prefix}/{component}" if prefix else component


def shorten_path(path: str) -> str:
    """A key path short enough for an error message (a deep one runs to kilobytes)."""
    return path if len(path) <= 120 else path[:120] + "..."


def type_path(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_rank_local(obj: Any) -> bool:
    """Placement by type: RankLocal, RNGState, data loaders and samplers with per-rank state."""
    return isinstance(obj, (RankLocal, RNGState)) or is_loader(obj) or is_rank_local_sampler(obj)


@dataclass
class FlatState:
    """A state tree taken apart: structure nodes plus the tensors at each key path."""

    tree: Node
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # key -> "tensor" | "ndarray" | "npscalar"
    rank_local_trees: dict[str, Node] = field(default_factory=dict)
    rank_local_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Module buffers (BatchNorm statistics...): under DDP each rank updates its own between
    # steps and rank 0's copy is the one DDP broadcasts, so rank 0 writes them, unchecked.
    rank0_keys: set[str] = field(default_factory=set)
    # Walking a set's elements or an enum's value: plain data only, no Stateful object (it
    # would come back as its state dict, a dict, where a hashable element was)
    data_only: str | None = None
    # Tensors seen, by where their bytes lie: a second key of the same bytes (tied weights)
    # is stored as an alias of the first, written once and loaded back sharing it
    seen: dict[tuple[Any, ...], str] = field(default_factory=dict)


def flatten_state(state: Any) -> FlatState:
    """Walk ``state`` once; raise TypeError naming the key path of anything unsaveable."""
    flat = FlatState(tree={})
    flat.tree = _visit(state, "", flat, False, 0)
    return flat


def _too_deep(path: str) -> NestingLimitError:
    return NestingLimitError(
        f"the state is nested deeper than {MAX_TREE_DEPTH} levels at key {shorten_path(path)!r}; "
        "a checkpoint of it could not be loaded, so nothing is saved"
    )


def _visit(obj: Any, path: str, flat: FlatState, rank_local: bool, depth: int) -> Node:
    """The structure node of ``obj``; ``depth`` counts the nodes above it, as the restore walk
    counts them, so that saving refuses exactly what loading would."""
    if depth >= MAX_TREE_DEPTH:
        raise _too_deep(path)
    cls = type(obj)
    # Fast paths for the exact types that fill most trees (a plain dict, tensor or scalar is
    # never Stateful nor rank-local); every subclass takes the general path below.
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return _tensor_leaf(obj, path, flat, rank_local, "tensor")
    if cls is dict:
        return {
            "d": [
                [_check_key(k, path), _visit(v, join_key(path, k), flat, rank_local, depth + 1)]
                for k, v in obj.items()
            ]
        }
    if cls is int or cls is str or cls is bool or obj is None:
        return {"v": obj}
    if isinstance(obj, torch.Tensor):
        return _tensor_leaf(obj, path, flat, rank_local, "tensor")
    if isinstance(obj, np.ndarray):
        return _tensor_leaf(_numpy_to_torch(obj, path), path, flat, rank_local, "ndarray")
    if isinstance(obj, np.generic):
        return _tensor_leaf(
            _numpy_to_torch(np.asarray(obj), path), path, flat, rank_local, "npscalar"
        )
    if is_rank_local(obj) and not rank_local:
        # restored as an "rl" node, then an "s" node, then the state dict
        flat.rank_local_trees[path] = {"s": _stateful_node(obj, path, flat, True, depth + 2)}
        return {"rl": path}
    if is_stateful(obj):
        if not rank_local:
            flat.rank0_keys.update(_rank0_keys(obj, path))
        return {"s": _stateful_node(obj, path, flat, rank_local, depth + 1)}
    if isinstance(obj, TYPED_BASES):
        return _typed_node(obj, path, flat, rank_local, depth)
    if isinstance(obj, dict):
        return {
            "d": [
                [_check_key(k, path), _visit(v, join_key(path, k), flat, rank_local, depth + 1)]
                for k, v in obj.items()
            ]
        }
    if isinstance(obj, (list, tuple)):
        children = [
            _visit(v, join_key(path, i), flat, rank_local, depth + 1) for i, v in enumerate(obj)
        ]
        return {"tu" if isinstance(obj, tuple) else "l": children}
    if isinstance(obj, float):
        return {"v": obj} if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, _JSON_SCALARS):
        return {"v": obj}
    raise TypeError(
        f"cannot checkpoint the value at key {path or '<root>'!r}: {type_path(obj)} is not a tensor, "
        "numpy array, JSON value, container, typed value (dtype, device, Size, Path, datetime, "
        "set, Namespace, Enum) or Stateful object (snapstate never pickles)"
    )


def _stateful_node(obj: Any, path: str, flat: FlatState, rank_local: bool, depth: int) -> Node:
    if flat.data_only is not None:
        raise TypeError(
            f"cannot checkpoint the value at key {path!r}: {type_path(obj)} is a Stateful object "
            f"inside the set or enum at {flat.data_only!r}, which holds only plain data"
        )
    state = state_of(obj, path)
    if isinstance(obj, torch.nn.Module) and not state:
        raise TypeError(
            f"cannot checkpoint the value at key {path!r}: {type_path(obj)} is a module with no "
            "parameters or buffers: nothing of it would be saved and it would come back as {}"
        )
    # A Stateful inside another's state dict (RankLocal(loader)) restores in place when the
    # target's state dict holds the live object, as the template walk hands it back
    return _visit(state, path, flat, rank_local, depth)


def _typed_node(obj: Any, path: str, flat: FlatState, rank_local: bool, depth: int) -> Node:
    """A dtype, device, Size, Path, datetime, set, Namespace or Enum (see state/typed.py)."""
    atom = atom_payload(obj, path)
    if atom is not None:
        return {"x": atom[0], "v": atom[1]}
    tag, value, class_path = container_parts(obj)
    if tag == "namespace":  # its attributes may hold anything a dict may
        return {"x": tag, "c": _visit(value, path, flat, rank_local, depth + 1)}
    child = _data_only(value, path, depth + 1)  # set elements and enum values: hashable data
    return {"x": tag, "c": child} if class_path is None else {"x": tag, "v": class_path, "c": child}


def _data_only(value: Any, path: str, depth: int) -> Node:
    scratch = FlatState(tree={}, data_only=path)
    node = _visit(value, path, scratch, True, depth)
    if scratch.rank_local_tensors or scratch.rank_local_trees:
        raise TypeError(
            f"cannot checkpoint the set or enum at key {path!r}: it holds a tensor or an "
            "array; only JSON and typed values are stored there"
        )
    return node


def _rank0_keys(obj: Any, path: str) -> list[str]:
    """Keys each replica updates on its own, whose rank-0 copy is the one to keep.

    PyTorch modules: their buffers (DDP broadcasts rank 0's). Any other Stateful names its
    own with ``divergent_replica_keys()``: key paths (tuples) into its ``state_dict``.
    """
    if isinstance(obj, torch.nn.Module):
        return [join_key(path, name) for name, _ in obj.named_buffers()]
    divergent = getattr(obj, "divergent_replica_keys", None)
    if not callable(divergent):
        return []
    keys = []
    for parts in divergent():
        key = path
        for part in parts:
            key = join_key(key, part)
        keys.append(key)
    return keys


def _tensor_leaf(t: torch.Tensor, path: str, flat: FlatState, rank_local: bool, kind: str) -> Node:
    if t.is_quantized or t.layout != torch.strided:
        raise TypeError(
            f"cannot checkpoint the tensor at key {path!r}: {t.layout} / {t.dtype} is not supported"
        )
    target = flat.rank_local_tensors if rank_local else flat.tensors
    if path in target:
        raise TypeError(f"two values map to the same key path {path!r} (a str key and an int key?)")
    where = _bytes_of(t) if kind == "tensor" and not rank_local else None
    if where is not None:
        first = flat.seen.setdefault(where, path)
        if first != path:
            return {"a": first}
    target[path] = t
    flat.kinds[path] = kind
    return {"t": path} if kind == "tensor" else {"n": path, "k": kind}


def _bytes_of(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Where a plain tensor's bytes lie: equal for two views of the same memory in the same
    shape (a tied weight and its alias); None for what is not deduplicated."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.numel() == 0:
        return None
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr(), t.storage_offset(), t.dtype, t.shape, t.stride())


def _check_key(key: Any, path: str) -> str | int:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(
            f"dict key {key!r} under {path or '<root>'!r} is a {type(key).__name__}; only str and int keys are saved"
        )
    return key


def _numpy_to_torch(arr: np.ndarray, path: str) -> torch.Tensor:
    if arr.dtype.hasobject or arr.dtype.kind not in "biufc":
        raise TypeError(
            f"cannot checkpoint the numpy array at key {path!r}: dtype {arr.dtype} is not numeric"
        )
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if any(s < 0 for s in arr.strides):
        arr = np.ascontiguousarray(arr)
    try:
        return torch.from_numpy(arr)
    except TypeError:  # numeric, but with no torch dtype (longdouble, clongdouble)
        raise TypeError(
            f"cannot checkpoint the numpy array at key {path!r}: dtype {arr.dtype} has no torch equivalent"
        ) from None

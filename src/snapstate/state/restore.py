"""Match a target state against a checkpoint's structure and plan in-place restoration.

The walk is pure bookkeeping: it lists which target tensors to fill from which stored key,
which Stateful objects get ``load_state_dict`` afterwards, and every difference found.
Reading the bytes is the engine's job.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from snapstate.errors import (
    CorruptCheckpointError,
    NestingLimitError,
    StateMismatch,
    StateRestoreError,
)
from snapstate.format.atoms import ATOM_TAGS, decode_atom
from snapstate.format.dtypes import empty_tensor
from snapstate.format.manifest import MANIFEST
from snapstate.format.tree import MAX_TREE_DEPTH
from snapstate.state.dtensor import allocate_like, optimizer_templates
from snapstate.state.flatten import Node, is_rank_local, join_key, shorten_path
from snapstate.state.loaders import is_loader, load_into, restore_template, state_of
from snapstate.state.stateful import is_stateful
from snapstate.state.typed import enum_class, enum_member


@dataclass(frozen=True)
class StoredTensor:
    """What the manifest says of one stored tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str  # "tensor" | "ndarray" | "npscalar"


@dataclass
class ReadRequest:
    key: str
    target: torch.Tensor
    rank_local: bool
    fresh: bool = False  # allocated by the load itself: nothing to put back if it fails


@dataclass
class RestorePlan:
    reads: list[ReadRequest] = field(default_factory=list)
    finalizers: list[Callable[[], None]] = field(default_factory=list)
    mismatches: list[StateMismatch] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # container slots to set; deferred so that a refused (strict) load changes nothing
    assignments: list[tuple[Any, Any, Any]] = field(default_factory=list)
    # the Stateful objects whose load_state_dict a finalizer calls: index -> (key path, object)
    stateful: dict[int, tuple[str, Any]] = field(default_factory=dict)

    def apply_structure(self) -> None:
        """Put the planned values in their containers (after the reads, before finalizers)."""
        for container, key, value in self.assignments:
            container[key] = value

    def untrusted_stateful(self) -> bool:
        """Whether a Stateful object's ``load_state_dict`` is the user's own (not torch's,
        torchdata's or snapstate's, which do not fail on a state already matched against
        them): the load then keeps copies of every tensor it overwrites, so that a raise in
        there can put them back."""
        return any(not _trusted_loader(obj) for _, obj in self.stateful.values())

    def finish(self, undo_reads: Callable[[], None], reads_undone: bool = True) -> None:
        """Set the containers' slots and run the finalizers (the Stateful objects'
        ``load_state_dict``) as one step: if one raises, ``undo_reads`` puts the tensors back,
        every slot gets its old value and every Stateful object its state from before the load,
        and a StateRestoreError names the object (its exception as the cause).
        ``reads_undone=False``: the tensors cannot be put back (a mapped load keeps no copies
        where every ``load_state_dict`` is trusted), and the error says so."""
        slots = [(c, k, _slot_value(c, k)) for c, k, _ in self.assignments]
        before = {i: _copied(state_of(obj, path)) for i, (path, obj) in self.stateful.items()}
        self.apply_structure()
        for i, finalize in enumerate(self.finalizers):
            try:
                finalize()
            except Exception as exc:
                undo_reads()
                refused = _put_back(slots, before, self.stateful, upto=i)
                path = self.stateful.get(i, ("",))[0]
                undone = (
                    "the load was undone and the state is as it was before it"
                    if reads_undone
                    else "every change but the tensors' new values was undone"
                )
                if refused:
                    undone += "; these refused their own earlier state: " + ", ".join(refused)
                raise StateRestoreError(
                    f"the load_state_dict of {path or '<root>'!r} raised {type(exc).__name__}: "
                    f"{exc}; {undone}",
                    key=path,
                ) from exc


_ABSENT = object()
_TRUSTED_MODULES = ("torch.", "torchdata.", "snapstate.")


def _trusted_loader(obj: Any) -> bool:
    method = getattr(type(obj), "load_state_dict", None)
    return is_loader(obj) or getattr(method, "__module__", "").startswith(_TRUSTED_MODULES)


def _slot_value(container: Any, key: Any) -> Any:
    try:
        return container[key]
    except (KeyError, IndexError):
        return _ABSENT


def _copied(value: Any) -> Any:
    """The containers of a state dict copied, its leaves shared: a load_state_dict that
    mutates the dict it was given back (or that ``state_dict`` returned live) cannot change
    the snapshot; tensors among the leaves are put back by the load's rollback. A shallow
    copy keeps the dict's type and attributes (a module's ``_metadata``)."""
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _copied(v)
        return out
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def _put_back(
    slots: list[tuple[Any, Any, Any]],
    before: dict[int, Any],
    stateful: dict[int, tuple[str, Any]],
    upto: int,
) -> list[str]:
    """Undo a load whose finalizer ``upto`` raised: slots first, then every Stateful object
    loaded so far (that one included: it may have half-applied), the latest first. Returns
    the objects that refused their own earlier state too (nothing more can be done there)."""
    for container, key, old in reversed(slots):
        if old is _ABSENT:
            del container[key]
        else:
            container[key] = old
    refused = []
    for i in sorted((i for i in stateful if i <= upto), reverse=True):
        path, obj = stateful[i]
        try:
            load_into(obj, before[i])
        except Exception as exc:  # noqa: BLE001 - reported in the StateRestoreError
            refused.append(f"{path or '<root>'!r} ({type(exc).__name__}: {exc})")
    return refused


Lookup = Callable[[str, bool], "StoredTensor | None"]
_MISSING = object()


class _Pending:
    """A value that exists only once the bytes are read: a numpy scalar (immutable, so it
    cannot be filled in place) or a tuple holding one. It takes its slot in a finalizer,
    which runs after the reads and before the enclosing object's ``load_state_dict``."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


def _resolved(value: Any) -> Any:
    return value.make() if isinstance(value, _Pending) else value


def _put(container: Any, key: Any, value: Any, walk: _Walk) -> None:
    if value is _MISSING:  # skipped rank-local state read as plain containers: left out
        return
    walk.plan.assignments.append((container, key, value))
    if isinstance(value, _Pending):
        walk.plan.finalizers.append(lambda: container.__setitem__(key, value.make()))


@dataclass
class _Walk:
    lookup: Lookup
    rank_local_trees: dict[str, Node] | None  # None: rank-local state is skipped
    plan: RestorePlan
    # optimizer state path -> its parameter
    templates: dict[str, torch.Tensor] = field(default_factory=dict)
    # tensors this walk allocated, by stored key: an alias gets the same tensor back
    allocated: dict[str, torch.Tensor] = field(default_factory=dict)
    depth: int = 0  # structure nodes open on the walk's stack
    wanted: tuple[str, ...] | None = None  # materializing: the key paths asked for (None: all)

    def wants(self, path: str) -> bool:
        """Whether ``path`` is asked for, lies above a key asked for, or below one."""
        if self.wanted is None:
            return True
        return any(
            k == path or k.startswith(path + "/") or path.startswith(k + "/") for k in self.wanted
        )


def plan_restore(
    target: Any, tree: Node, lookup: Lookup, rank_local_trees: dict[str, Node] | None
) -> RestorePlan:
    """Plan filling ``target`` (a dict or Stateful, changed in place) from a checkpoint tree."""
    walk = _Walk(lookup, rank_local_trees, RestorePlan())
    if not isinstance(target, dict) and not is_stateful(target):
        raise TypeError(
            f"the state to load into must be a dict or a Stateful object, not {type(target).__name__}"
        )
    _restore(target, tree, "", walk, rebuild=False, rank_local=False)
    return walk.plan


def matches_nothing(target: Any, tree: Node) -> StateMismatch | None:
    """A dict target that names no top-level key of the checkpoint: loading it would be a
    silent no-op, so it is refused (strict or not)."""
    if not isinstance(target, dict) or "d" not in tree:
        return None
    stored = [key for key, _ in tree["d"]]
    if any(key in target for key in stored):
        return None
    shown = ", ".join(map(repr, stored[:20])) + (", ..." if len(stored) > 20 else "")
    asked = ", ".join(map(repr, list(target)[:20])) or "nothing"
    return StateMismatch(
        "<root>", f"the target ({asked}) matches no key of the checkpoint, which holds {shown}"
    )


def plan_materialize(
    tree: Node,
    lookup: Lookup,
    rank_local_trees: dict[str, Node] | None,
    wanted: tuple[str, ...] | None = None,
) -> tuple[Any, RestorePlan]:
    """Build the checkpoint's structure as plain containers with newly allocated tensors:
    all of it, or the branches of the key paths ``wanted`` (dict keys outside them are left
    out). Skipped rank-local state (``rank_local_trees`` None) is left out and listed in
    ``plan.skipped``."""
    walk = _Walk(lookup, rank_local_trees, RestorePlan(), wanted=wanted)
    return _restore(_MISSING, tree, "", walk, rebuild=True, rank_local=False), walk.plan


def _restore(
    target: Any, node: Node, path: str, walk: _Walk, rebuild: bool, rank_local: bool
) -> Any:
    """Return the value that should stand at ``path`` after loading (often ``target`` itself).

    ``rebuild`` is true inside Stateful objects: there the checkpoint's structure wins, so
    containers the target lacks (lazily created optimizer state) are built from the manifest.
    """
    if walk.depth >= MAX_TREE_DEPTH:
        raise NestingLimitError(
            f"the stored structure is nested deeper than {MAX_TREE_DEPTH} levels, the limit of "
            f"this snapstate (file {MANIFEST}, key {shorten_path(path)!r})"
        )
    walk.depth += 1
    try:
        return _restore_node(target, node, path, walk, rebuild, rank_local)
    finally:
        walk.depth -= 1


def _restore_node(
    target: Any, node: Node, path: str, walk: _Walk, rebuild: bool, rank_local: bool
) -> Any:
    if "t" in node or "n" in node:
        return _restore_tensor(target, node, path, walk, rank_local)
    if "a" in node:  # an alias (tied weight): the bytes stored under the first key
        return _restore_tensor(target, {"t": node["a"]}, path, walk, rank_local)
    if "x" in node:
        return _restore_typed(target, node, path, walk, rank_local)
    if "v" in node:
        return node["v"]
    if "f" in node:
        return float(node["f"])
    if "rl" in node:
        return _restore_rank_local(target, node, path, walk)
    if "s" in node:
        return _restore_stateful(target, node["s"], path, walk, rank_local)
    if target is None:  # a plain value slot: take the checkpoint's structure whole
        target, rebuild = _MISSING, True
    if "d" in node:
        return _restore_dict(target, node["d"], path, walk, rebuild, rank_local)
    children = node.get("l", node.get("tu"))
    if children is None:
        walk.plan.mismatches.append(StateMismatch(path, f"unknown structure node {sorted(node)}"))
        return target
    return _restore_sequence(target, children, "tu" in node, path, walk, rebuild, rank_local)


def _restore_dict(
    target: Any, items: list, path: str, walk: _Walk, rebuild: bool, rank_local: bool
) -> Any:
    stored = {k: child for k, child in items}
    if not isinstance(target, dict):
        if not rebuild and target is not _MISSING:
            walk.plan.mismatches.append(
                StateMismatch(path, f"target is a {type(target).__name__}, checkpoint holds a dict")
            )
            return target
        target = {}
    for key in list(target):
        if key not in stored:
            walk.plan.mismatches.append(StateMismatch.missing(join_key(path, key)))
    for key, child in stored.items():
        sub = join_key(path, key)
        if key in target:
            _put(target, key, _restore(target[key], child, sub, walk, rebuild, rank_local), walk)
        elif rebuild and walk.wants(sub):
            _put(target, key, _restore(_MISSING, child, sub, walk, rebuild, rank_local), walk)
    return target


def _restore_sequence(
    target: Any,
    children: list,
    as_tuple: bool,
    path: str,
    walk: _Walk,
    rebuild: bool,
    rank_local: bool,
) -> Any:
    same_shape = isinstance(target, (list, tuple)) and len(target) == len(children)
    if not same_shape and not rebuild:
        walk.plan.mismatches.append(
            StateMismatch(
                path,
                f"target is {_describe(target)}, checkpoint holds a sequence of {len(children)}",
            )
        )
        return target
    olds = list(target) if same_shape else [_MISSING] * len(children)
    values = [
        _restore(old, c, join_key(path, i), walk, rebuild, rank_local)
        for i, (old, c) in enumerate(zip(olds, children))
    ]
    if as_tuple:
        if any(isinstance(v, _Pending) for v in values):
            return _Pending(lambda: tuple(_resolved(v) for v in values))
        return tuple(values)
    out = target if isinstance(target, list) and same_shape else [None] * len(values)
    for i, v in enumerate(values):
        _put(out, i, v, walk)
    return out


def _restore_stateful(target: Any, node: Node, path: str, walk: _Walk, rank_local: bool) -> Any:
    if target is _MISSING:  # materializing: a Stateful object becomes its plain state dict
        return _restore(_MISSING, node, path, walk, rebuild=True, rank_local=rank_local)
    if not is_stateful(target):
        walk.plan.mismatches.append(
            StateMismatch(
                path, f"checkpoint holds a Stateful object, target is {_describe(target)}"
            )
        )
        return target
    # lazily created state is placed like its parameter
    walk.templates.update(optimizer_templates(target, path))
    template = restore_template(target)  # data loaders: see state/loaders.py
    new_sd = _restore(template, node, path, walk, rebuild=True, rank_local=rank_local)
    walk.plan.stateful[len(walk.plan.finalizers)] = (path, target)
    walk.plan.finalizers.append(lambda: load_into(target, _resolved(new_sd)))
    return target


def _restore_typed(target: Any, node: Node, path: str, walk: _Walk, rank_local: bool) -> Any:
    """A typed value replaces the target's slot, as a plain value does (see state/typed.py)."""
    tag = node["x"]
    if tag in ATOM_TAGS:
        return decode_atom(tag, node["v"])
    if tag == "namespace":
        attrs = _restore(_MISSING, node["c"], path, walk, rebuild=True, rank_local=rank_local)
        return _Pending(lambda: argparse.Namespace(**{str(k): v for k, v in attrs.items()}))
    value = _restore(_MISSING, node["c"], path, walk, rebuild=True, rank_local=rank_local)
    if tag == "enum":
        return _restore_enum(target, node["v"], value, path, walk)
    kind = frozenset if tag == "frozenset" else set
    return _Pending(lambda: _hashed(kind, _resolved(value), path))  # its list fills in later


def _hashed(kind: type, elements: Any, path: str) -> Any:
    try:
        return kind(elements)
    except TypeError:
        raise CorruptCheckpointError(
            "a set holds an element that is not hashable", file=MANIFEST, key=path
        ) from None


def _restore_enum(target: Any, class_path: str, value: Any, path: str, walk: _Walk) -> Any:
    cls = enum_class(class_path, target)
    member = enum_member(cls, value) if cls is not None else None
    if member is not None:
        return member
    problem = (
        f"enum {class_path} has no member of value {value!r}"
        if cls is not None
        else f"holds a member of enum {class_path}, which is not imported in this process: "
        "import its module first (snapstate never imports a module a checkpoint names)"
    )
    walk.plan.mismatches.append(StateMismatch(path, problem[:300]))
    return target


def _restore_rank_local(target: Any, node: Node, path: str, walk: _Walk) -> Any:
    if walk.rank_local_trees is None:
        walk.plan.skipped.append(path)
        return target
    sub = walk.rank_local_trees.get(node["rl"])
    if sub is None:
        walk.plan.mismatches.append(
            StateMismatch(path, "rank-local state of this rank missing in checkpoint")
        )
        return target
    if target is _MISSING:
        return _restore(_MISSING, sub, path, walk, rebuild=True, rank_local=True)
    if not is_rank_local(target):
        walk.plan.mismatches.append(
            StateMismatch(path, f"checkpoint holds rank-local state, target is {_describe(target)}")
        )
        return target
    return _restore(target, sub, path, walk, rebuild=True, rank_local=True)


def _restore_tensor(target: Any, node: Node, path: str, walk: _Walk, rank_local: bool) -> Any:
    key = str(node.get("t", node.get("n")))
    stored = walk.lookup(key, rank_local)
    if stored is None:
        walk.plan.mismatches.append(StateMismatch(path, "tensor entry missing from manifest"))
        return target
    if target is _MISSING or target is None:
        return _allocate(key, stored, walk, rank_local)
    if isinstance(target, np.generic):  # immutable: replaced by the stored value
        problem = _compare(torch.from_numpy(np.asarray(target)), stored)
        if problem:
            walk.plan.mismatches.append(StateMismatch(path, problem))
            return target
        return _allocate(key, stored, walk, rank_local)
    as_torch = _as_torch_view(target)
    if as_torch is None:
        walk.plan.mismatches.append(
            StateMismatch(path, f"checkpoint holds a {stored.kind}, target is {_describe(target)}")
        )
        return target
    problem = _compare(as_torch, stored)
    if problem:
        walk.plan.mismatches.append(StateMismatch(path, problem))
        return target
    walk.plan.reads.append(ReadRequest(key, as_torch, rank_local))
    return target


def _allocate(key: str, stored: StoredTensor, walk: _Walk, rank_local: bool) -> Any:
    shared = walk.allocated.get(key) if stored.kind == "tensor" and not rank_local else None
    if shared is not None:
        return shared
    template = (
        walk.templates.get(key.rsplit("/", 1)[0])
        if stored.kind == "tensor" and not rank_local
        else None
    )
    placed = allocate_like(template, stored.shape, stored.dtype) if template is not None else None
    tensor = placed if placed is not None else empty_tensor(stored.shape, stored.dtype)
    walk.plan.reads.append(ReadRequest(key, tensor, rank_local, fresh=True))
    if stored.kind == "tensor":
        if not rank_local:
            walk.allocated[key] = tensor
        return tensor
    array = tensor.numpy()
    return _Pending(lambda: array[()]) if stored.kind == "npscalar" else array


def _as_torch_view(target: Any) -> torch.Tensor | None:
    """A torch view sharing memory with the target, so the read fills it in place."""
    if isinstance(target, torch.Tensor):
        return target
    if isinstance(target, np.ndarray) and target.flags.writeable and target.dtype.isnative:
        try:
            return torch.from_numpy(target)
        except (TypeError, ValueError):
            return None
    return None


def _compare(target: torch.Tensor, stored: StoredTensor) -> str | None:
    shape = tuple(target.shape)
    if shape != stored.shape:
        return f"shape {list(shape)} in target, {list(stored.shape)} in checkpoint"
    if target.dtype != stored.dtype:
        return f"dtype {target.dtype} in target, {stored.dtype} in checkpoint"
    return None


def _describe(value: Any) -> str:
    if value is _MISSING:
        return "absent"
    return f"a {type(value).__name__}"

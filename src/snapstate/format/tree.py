"""Validation of a manifest's structure tree (SPEC.md, "Structure tree"), untrusted input walked without recursion."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from snapstate.format.atoms import ATOM_TAGS, CHILD_TAGS, atom_problem

FLOAT_NAMES = ("nan", "inf", "-inf")
NUMPY_KINDS = ("ndarray", "npscalar")
# The one nesting limit of a state tree, for save and load alike: saving refuses what loading
# would refuse. The restore walk recurses (a few frames per level), so the limit keeps it far
# from the interpreter's stack; no real training state comes near it.
MAX_TREE_DEPTH = 200
_SINGLE = frozenset({"d", "l", "tu", "t", "a", "v", "f", "s", "rl"})


# A node on the walk's stack: (node, the entry of its parent, its key or index there). The
# path of a node is built from the chain only when the node is wrong: formatting it for
# every node took a quarter of a manifest's validation.
_Entry = tuple[Any, Any, Any]


def tree_problem(root: Any, tensor_keys: Container[str]) -> str | None:
    """What is wrong with ``root`` (None if nothing): a node of no known kind, a malformed one,
    or a tensor node naming a key that ``tensor_keys`` lacks. Restoring walks only valid trees."""
    stack: list[_Entry] = [(root, None, None)]
    while stack:
        entry = stack.pop()
        problem = _node_problem(entry, tensor_keys, stack)
        if problem:
            return f"structure node at {_where(entry)}: {problem}"
    return None


def _where(entry: _Entry) -> str:
    parts = []
    while entry[1] is not None:
        parts.append(str(entry[2]))
        entry = entry[1]
    return "/".join(["<root>", *reversed(parts)])


def _node_problem(entry: _Entry, tensor_keys: Container[str], stack: list[_Entry]) -> str | None:
    node = entry[0]
    if not isinstance(node, dict):
        return f"expected an object, got {type(node).__name__}"
    if "x" in node:
        return _typed_problem(node, entry, stack)
    if len(node) == 2 and "n" in node and "k" in node:
        if node["k"] not in NUMPY_KINDS:
            return f"unknown numpy kind {node['k']!r}"
        return _tensor_problem(node["n"], tensor_keys)
    if len(node) != 1:
        return f"unknown kind {sorted(node)!r}"[:200]
    (kind,) = node
    if kind not in _SINGLE:
        return f"unknown kind {[kind]!r}"[:200]
    value = node[kind]
    if kind == "d":
        return _dict_problem(value, stack, entry)
    if kind in ("l", "tu"):
        if not isinstance(value, list):
            return "a list node does not hold a list"
        stack.extend((child, entry, i) for i, child in enumerate(value))
    elif kind == "s":
        stack.append((value, entry[1], entry[2]))  # the same place in the tree
    elif kind in ("t", "a"):  # a tensor, or an alias of one stored under another key
        return _tensor_problem(value, tensor_keys)
    elif kind == "f" and value not in FLOAT_NAMES:
        return f"float node {value!r} is not one of {FLOAT_NAMES}"[:200]
    elif kind == "rl" and not isinstance(value, str):
        return "rank-local node does not name a path"
    return None


def _dict_problem(items: Any, stack: list[_Entry], entry: _Entry) -> str | None:
    if not isinstance(items, list):
        return "a dict node does not hold a list of [key, node] pairs"
    for item in items:
        if not isinstance(item, list) or len(item) != 2:
            return "a dict entry is not a [key, node] pair"
        key, child = item
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            return f"dict key {key!r} is not a string or an integer"[:200]
        stack.append((child, entry, key))
    return None


def _tensor_problem(key: Any, tensor_keys: Container[str]) -> str | None:
    if not isinstance(key, str):
        return "a tensor node does not name a key"
    if key not in tensor_keys:
        return f"tensor {key!r} is not in the manifest's tensors"[:200]
    return None


def _typed_problem(node: dict, entry: _Entry, stack: list[_Entry]) -> str | None:
    """A typed value (state/typed.py): an atom with its payload, or a tag around a child."""
    tag = node["x"]
    if not isinstance(tag, str):
        return "a typed value's tag is not a string"
    if tag in ATOM_TAGS and sorted(node) == ["v", "x"]:
        return atom_problem(tag, node["v"])
    expected = ["c", "v", "x"] if tag == "enum" else ["c", "x"]
    if tag not in CHILD_TAGS or sorted(node) != expected:
        return f"unknown typed value {tag!r} with fields {sorted(node)!r}"[:200]
    if tag == "enum" and (not isinstance(node["v"], str) or ":" not in node["v"]):
        return "an enum node does not name its class as 'module:qualname'"
    stack.append((node["c"], entry[1], entry[2]))  # the same place in the tree
    return None

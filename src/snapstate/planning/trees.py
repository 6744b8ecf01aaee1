"""Merging the state structure of ranks whose trees differ (pipeline stages hold other keys)."""

from __future__ import annotations

from typing import Any

Node = dict[str, Any]


def merge_trees(base: Node, others: list[Node]) -> Node:
    """``base`` with every dict entry the others add; where both hold a key, ``base`` wins."""
    merged = base
    for other in others:
        merged = _merge(merged, other)
    return merged


def _merge(a: Node, b: Node) -> Node:
    for tag in ("d", "s"):
        if tag in a and tag in b:
            if tag == "s":
                return {"s": _merge(a["s"], b["s"])}
            return {"d": _merge_items(a["d"], b["d"])}
    return a


def _merge_items(a: list[list[Any]], b: list[list[Any]]) -> list[list[Any]]:
    index = {_key(k): i for i, (k, _) in enumerate(a)}
    out = [list(item) for item in a]
    for k, node in b:
        i = index.get(_key(k))
        if i is None:
            index[_key(k)] = len(out)
            out.append([k, node])
        else:
            out[i][1] = _merge(out[i][1], node)
    return out


def _key(k: Any) -> tuple[str, Any]:
    return (type(k).__name__, k)  # 0 and "0" are different keys

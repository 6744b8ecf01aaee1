"""Fuzzing manifests and shard headers: load, verify and inspect raise CheckpointError or succeed,
never anything else, never hang, and never allocate more than the checkpoint's files hold."""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import snapstate as ss

from .corrupt import SHARD, SMALL_OPTIONS, blank_small_state, read_header, sealed, small_state

Path_ = list[Any]  # a path into a JSON document: keys and indices

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(
        [
            "float32",
            "F32",
            "model/w",
            "shards/r00000-000.safetensors",
            "../x",
            "/etc/passwd",
            "t",
            "d",
            "nan",
            "snapstate",
        ]
    )
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=6,
)
SPECIAL_INTS = [
    -1,
    0,
    1,
    7,
    63,
    64,
    1023,
    1024,
    2**31,
    2**32,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    10**12,
    10**30,
    -(2**63),
]
OPS = ["replace", "delete", "insert", "number", "retype", "duplicate"]
MUTATION = st.tuples(
    st.integers(0, 10**6), st.sampled_from(OPS), JSON_VALUES, st.sampled_from(SPECIAL_INTS)
)


def json_paths(doc: Any, prefix: Path_ | None = None) -> list[Path_]:
    """Every position in ``doc`` (the root excluded), depth first."""
    prefix = prefix or []
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    )
    out = []
    for k, v in items:
        out.append([*prefix, k])
        out.extend(json_paths(v, [*prefix, k]))
    return out


def mutate(doc: Any, mutation: tuple[int, str, Any, int]) -> Any:
    """Apply one edit at one position of the document, in place where possible."""
    index, op, value, number = mutation
    paths = json_paths(doc)
    if not paths:
        return value
    path = paths[index % len(paths)]
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    if op == "delete":
        del parent[key]
    elif op == "insert" and isinstance(old, dict):
        old[str(value)[:6]] = value
    elif op == "insert" and isinstance(old, list):
        old.insert(index % (len(old) + 1), value)
    elif op == "number" and isinstance(old, int) and not isinstance(old, bool):
        parent[key] = [number, old + 1, old - 1, old * 2, -old, number + old][index % 6]
    elif op == "retype":
        parent[key] = [
            str(old),
            [old],
            {"x": old},
            None,
            True,
            float(old) if isinstance(old, int) else 1.5,
        ][index % 6]
    elif op == "duplicate" and isinstance(parent, list):
        parent.append(json.loads(json.dumps(old)))
    else:
        parent[key] = value
    return doc


class Target:
    """The pristine checkpoint and a scratch copy that each example damages."""

    def __init__(self, root: Path) -> None:
        self.pristine, self.scratch = root / "pristine", root / "scratch"
        ss.save(small_state(), self.pristine, options=SMALL_OPTIONS)
        shutil.copytree(self.pristine, self.scratch)
        self.manifest = (self.pristine / "manifest.json").read_bytes()
        self.shard = (self.pristine / SHARD).read_bytes()

    def write(self, manifest: bytes | None = None, shard: bytes | None = None) -> None:
        (self.scratch / "manifest.json").write_bytes(
            self.manifest if manifest is None else manifest
        )
        (self.scratch / SHARD).write_bytes(self.shard if shard is None else shard)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    return Target(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def allocation_cap() -> Iterator[None]:
    """Fail any example that asks torch for more than the whole checkpoint could hold."""
    real_empty = torch.empty

    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        dims = (
            size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        )
        if dims and all(isinstance(d, int) for d in dims):
            assert (
                math.prod(dims) * real_empty(0, dtype=kwargs.get("dtype")).element_size() <= 1 << 20
            ), f"torch.empty{tuple(dims)}"
        return real_empty(*size, **kwargs)

    torch.empty = empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = real_empty  # type: ignore[assignment]


def _load(path: Path) -> Any:
    return ss.load(blank_small_state(), path)


def _load_loose(path: Path) -> Any:
    state = blank_small_state()
    state["model"]["b"] = None  # a plain slot: the checkpoint's tensor is allocated for it
    state["opt"] = {}  # nothing to fill: skipped keys and extra ones
    return ss.load(state, path, strict=False)


READERS: list[Callable[[Path], Any]] = [_load, _load_loose, ss.verify, ss.inspect]


def read_all(path: Path) -> None:
    """Each reader either works or raises a CheckpointError; anything else fails the example."""
    for reader in READERS:
        try:
            reader(path)
        except ss.CheckpointError:
            pass


FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)


@pytest.mark.timeout(300)
@FUZZ
@given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
def test_fuzz_manifest_json(
    target: Target, allocation_cap: None, mutations: list[tuple[int, str, Any, int]]
) -> None:
    doc: Any = json.loads(target.manifest)
    for m in mutations:
        doc = mutate(doc, m)
    target.write(manifest=sealed(doc))
    read_all(target.scratch)


RAW_EDITS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "cut", "insert", "delete"]),
        st.integers(0, 10**6),
        st.binary(min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=3,
)


def edit_bytes(raw: bytes, edits: list[tuple[str, int, bytes]], limit: int | None = None) -> bytes:
    """Byte-level damage within the first ``limit`` bytes (all of them by default)."""
    data = bytearray(raw)
    for op, where, blob in edits:
        at = where % max(1, min(len(data), limit or len(data)))
        if op == "flip" and data:
            data[at] ^= blob[0] or 1
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = blob
        else:
            del data[at : at + len(blob)]
    return bytes(data)


@pytest.mark.timeout(300)
@FUZZ
@given(edits=RAW_EDITS)
def test_fuzz_manifest_bytes(
    target: Target, allocation_cap: None, edits: list[tuple[str, int, bytes]]
) -> None:
    target.write(manifest=edit_bytes(target.manifest, edits))
    read_all(target.scratch)


@pytest.mark.timeout(300)
@FUZZ
@given(
    edits=RAW_EDITS,
    size=st.none()
    | st.sampled_from([0, 1, 7, 8, 2**31, 2**63, 2**64 - 1, 200 << 20])
    | st.integers(0, 20_000),
)
def test_fuzz_shard_header_bytes(
    target: Target, allocation_cap: None, edits: list[tuple[str, int, bytes]], size: int | None
) -> None:
    _, header_size = read_header(target.pristine / SHARD)
    shard = edit_bytes(target.shard, edits, limit=8 + header_size)
    if size is not None and len(shard) >= 8:
        shard = struct.pack("<Q", size) + shard[8:]
    target.write(shard=shard)
    read_all(target.scratch)


@pytest.mark.timeout(300)
@FUZZ
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3), keep_length=st.booleans())
def test_fuzz_shard_header_json(
    target: Target,
    allocation_cap: None,
    mutations: list[tuple[int, str, Any, int]],
    keep_length: bool,
) -> None:
    header, size = read_header(target.pristine / SHARD)
    doc: Any = header
    for m in mutations:
        doc = mutate(doc, m)
    text = json.dumps(doc, separators=(",", ":")).encode()
    if keep_length and len(text) <= size:  # data stays where it was: only the header lies
        text += b" " * (size - len(text))
    target.write(shard=struct.pack("<Q", len(text)) + text + target.shard[8 + size :])
    read_all(target.scratch)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(FUZZ, max_examples=3000, derandomize=False)
@given(
    mutations=st.lists(MUTATION, min_size=1, max_size=6),
    raw=RAW_EDITS,
    which=st.sampled_from(["json", "bytes", "header"]),
)
def test_fuzz_long(
    target: Target,
    allocation_cap: None,
    mutations: list[tuple[int, str, Any, int]],
    raw: list[tuple[str, int, bytes]],
    which: str,
) -> None:
    if which == "json":
        doc: Any = json.loads(target.manifest)
        for m in mutations:
            doc = mutate(doc, m)
        target.write(manifest=sealed(doc))
    elif which == "bytes":
        target.write(manifest=edit_bytes(target.manifest, raw))
    else:
        _, header_size = read_header(target.pristine / SHARD)
        target.write(shard=edit_bytes(target.shard, raw, limit=8 + header_size))
    read_all(target.scratch)

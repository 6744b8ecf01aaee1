"""Hostile grid-form tensors (format version 5): each is a CorruptCheckpointError naming the
manifest, the key and what is wrong, raised before the grid is expanded into chunks."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import snapstate as ss
from snapstate.format import grid

from .corrupt import edit_manifest, read_manifest, sealed
from .test_fuzz import MUTATION, mutate

# 1 KB chunks: `w` (16 KB) is a grid of 16 rows of chunks, `v` another of 16
OPTIONS = ss.SaveOptions(plan=ss.PlanOptions(chunk_bytes=1024), block_bytes=512)
READERS: dict[str, Callable[[Path], Any]] = {
    "load": lambda p: ss.load(blank(), p),
    "verify": ss.verify,
    "inspect": ss.inspect,
}


def state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {"w": torch.randn(64, 64, generator=gen), "v": torch.randn(256, 16, generator=gen)}


def blank() -> dict[str, Any]:
    return {k: torch.zeros_like(t) for k, t in state().items()}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    with pytest.MonkeyPatch.context() as patch:  # grids in a small manifest
        patch.setattr(grid, "GRID_MIN_MANIFEST_CHUNKS", 1)
        ss.save(state(), path, options=OPTIONS)
    doc = read_manifest(path)
    assert doc["version"] == 5 and "grid" in doc["tensors"]["w"] and "grid" in doc["tensors"]["v"]
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def expect(ckpt: Path, *fragments: str) -> None:
    for name, read in READERS.items():
        with pytest.raises(ss.CorruptCheckpointError) as info:
            read(ckpt)
        for fragment in ("manifest.json", *fragments):
            assert fragment in str(info.value), f"{name}: {fragment!r} not in {info.value}"


def w(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tensors"]["w"]


def test_pristine_reads(ckpt: Path) -> None:
    target = blank()
    ss.load(target, ckpt)
    assert all(torch.equal(target[k], t) for k, t in state().items())


EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "grid in a version 2 manifest": (lambda d: d.update(version=2), ("version 2", "has a grid")),
    "grid and chunks": (lambda d: w(d).update(chunks=[]), ("both chunks and a grid", "w")),
    "rank-local grid": (lambda d: w(d).update(placement="rank_local"), ("rank-local", "w")),
    "grid not a list": (lambda d: w(d).update(grid={"a": 1}), ("w/grid", "not a list")),
    "grid of the wrong rank": (lambda d: w(d).update(grid=[[0, 64]]), ("w/grid", "2 lists")),
    "cuts not rising": (lambda d: w(d)["grid"][0].insert(2, 1), ("w/grid", "do not rise")),
    "cuts short of the shape": (lambda d: w(d)["grid"][1].__setitem__(-1, 63), ("w/grid", "to 64")),
    "negative cut": (lambda d: w(d)["grid"][0].__setitem__(0, -4), ("w/grid", "not an integer")),
    "a start missing": (lambda d: w(d)["start"].pop(), ("w", "15 starts")),
    "file indices missing": (lambda d: w(d).update(file=[0]), ("w", "1 file indices")),
    "file index out of range": (lambda d: w(d)["file"].__setitem__(3, 7), ("w/file", "not below")),
    "start beyond the file": (lambda d: w(d)["start"].__setitem__(15, 1 << 40), ("w", "beyond")),
    "block_bytes zero": (lambda d: w(d).update(block_bytes=0), ("w/block_bytes",)),
    "checksum not hex": (lambda d: w(d).update(xxh3="zz" + w(d)["xxh3"][2:]), ("w", "hex")),
    "checksums too few": (lambda d: w(d).update(xxh3=w(d)["xxh3"][:-16]), ("w/xxh3", "too few")),
    "checksums too many": (lambda d: w(d).update(xxh3=w(d)["xxh3"] * 2), ("w", "too many")),
    "chunks sharing bytes": (
        lambda d: d["tensors"]["v"].update(start=w(d)["start"]),
        ("share bytes",),
    ),
    "more cells than the files hold": (
        lambda d: [f.update(bytes=8) for f in d["files"].values()],
        ("w", "cannot fit"),
    ),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_hostile_grid_is_refused(ckpt: Path, case: str) -> None:
    edit, fragments = EDITS[case]
    edit_manifest(ckpt, edit)
    expect(ckpt, *fragments)


def test_a_huge_grid_is_refused_before_it_is_expanded(ckpt: Path) -> None:
    """10^10 cells named by a few hundred kilobytes: refused by its lists' length."""
    cuts = list(range(0, 10**5 + 1))
    edit_manifest(ckpt, lambda d: w(d).update(shape=[10**5, 10**5], grid=[cuts, cuts]))
    expect(ckpt, "w", "a grid of more cells has 16 file indices")


def test_grids_beyond_the_manifest_cap_are_refused(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grid, "MAX_GRID_CHUNKS", 20)  # `w` fits, `v` then passes the cap
    expect(ckpt, "expand to more than 20 chunks")


def test_an_altered_checksum_of_a_grid_chunk_fails_the_data_readers(ckpt: Path) -> None:
    def alter(d: dict[str, Any]) -> None:  # the 5th block's digest, resealed
        digests = w(d)["xxh3"]
        at = 4 * grid.DIGEST_CHARS
        w(d)["xxh3"] = digests[:at] + ("0" if digests[at] != "0" else "1") + digests[at + 1 :]

    edit_manifest(ckpt, alter)
    assert len(ss.inspect(ckpt).tensors["w"].chunks) == 16  # still a valid manifest
    for read in (READERS["load"], READERS["verify"]):
        with pytest.raises(ss.CorruptCheckpointError, match="w"):
            read(ckpt)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(mutation=MUTATION)
def test_fuzzed_grid_loads_exactly_or_raises(pristine: Path, tmp_path: Path, mutation: Any) -> None:
    """Any one edit inside a grid record (resealed): a CheckpointError, or the exact state."""
    ckpt = tmp_path / "fuzzed"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    shutil.copytree(pristine, ckpt)
    doc = read_manifest(ckpt)
    doc["tensors"]["w"] = mutate(doc["tensors"]["w"], mutation)
    (ckpt / "manifest.json").write_bytes(sealed(doc))
    target = blank()
    try:
        ss.load(target, ckpt)
    except ss.CheckpointError:
        return
    assert all(torch.equal(target[k], t) for k, t in state().items())

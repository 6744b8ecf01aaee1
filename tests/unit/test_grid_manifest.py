"""Manifests in grid form (format version 5): a tensor of many chunks is written as its grid,
and every reader (load, read_state, verify, inspect, export) sees the same chunks as in the
chunk-list form, checksums verified as before; small checkpoints stay version 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import snapstate as ss
from snapstate.export import export_checkpoint
from snapstate.format import grid
from snapstate.format.manifest import GRID_VERSION, parse_manifest
from support.bits import tree_differences
from support.states import blank_like

# 512-byte chunks: the 16 KB `w` becomes 32 chunks (a grid of rows), `cube` 24 and `half` 16
OPTIONS = ss.SaveOptions(plan=ss.PlanOptions(chunk_bytes=512), block_bytes=256)


def state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(128, 32, generator=gen),
        "cube": torch.randint(-9, 9, (96, 4, 8), generator=gen, dtype=torch.int32),
        "half": torch.randn(256, 16, generator=gen).to(torch.bfloat16),
        "b": torch.randn(4, generator=gen),
        "epoch": 3,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grid") / "ckpt"
    with pytest.MonkeyPatch.context() as patch:  # a manifest of 4,096 chunks in a small save
        patch.setattr(grid, "GRID_MIN_MANIFEST_CHUNKS", 1)
        ss.save(state(), path, options=OPTIONS)
    return path


def raw(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_bytes())


def test_many_chunks_are_written_as_a_grid(saved: Path) -> None:
    doc = raw(saved)
    assert doc["version"] == GRID_VERSION
    tensors = doc["tensors"]
    for key in ("w", "cube", "half"):
        assert "grid" in tensors[key] and "chunks" not in tensors[key], key
    assert tensors["w"]["grid"] == [list(range(0, 129, 4)), [0, 32]]
    assert "chunks" in tensors["b"]  # one chunk: a list, as before


def test_grid_reads_as_the_same_chunks_as_the_list_form(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = ss.inspect(saved)
    assert len(manifest.tensors["w"].chunks) == 32
    monkeypatch.setattr(grid, "GRID_MIN_CHUNKS", 1 << 30)
    listed = manifest.to_json()
    assert json.loads(listed)["version"] == 2
    again = parse_manifest(listed)
    assert again.tensors == manifest.tensors and again.files == manifest.files


def test_every_reader_reads_a_grid_manifest_bitwise(saved: Path, tmp_path: Path) -> None:
    expected = state()
    target = blank_like(expected)
    ss.load(target, saved)
    assert not tree_differences(target, expected)
    assert not tree_differences(ss.read_state(saved), expected)
    report = ss.verify(saved)
    assert report.ok and report.chunks == sum(
        len(t.chunks) for t in ss.inspect(saved).tensors.values()
    )
    export_checkpoint(saved, "safetensors", tmp_path / "out.safetensors")
    exported = load_file(str(tmp_path / "out.safetensors"))
    assert all(torch.equal(exported[k], expected[k]) for k in ("w", "cube", "half", "b"))


def test_a_damaged_block_of_a_grid_chunk_is_found(saved: Path, tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    chunk = ss.inspect(ckpt).tensors["w"].chunks[7]
    with open(ckpt / chunk.file, "r+b") as f:  # the chunk's second block
        f.seek(chunk.start + 300)
        byte = f.read(1)
        f.seek(chunk.start + 300)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ss.CorruptCheckpointError, match="w"):
        ss.verify(ckpt)
    with pytest.raises(ss.CorruptCheckpointError):
        ss.load(blank_like(state()), ckpt)


def test_few_chunks_stay_version_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ss.save(state(), tmp_path / "manifest", options=OPTIONS)  # 73 chunks in all
    assert raw(tmp_path / "manifest")["version"] == 2
    monkeypatch.setattr(grid, "GRID_MIN_MANIFEST_CHUNKS", 1)
    ss.save({"w": torch.ones(8, 8)}, tmp_path / "tensor")  # one chunk
    assert raw(tmp_path / "tensor")["version"] == 2


def test_two_dimensional_grids_of_a_sharded_job_read_as_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """plan-sim's manifest of 64 ranks (TP cuts columns or rows, ZeRO cuts rows): its grids
    expand to exactly the chunks of its chunk-list form."""
    from snapstate.planning.layout import plan_save
    from snapstate.plansim import Model, SimConfig, _manifest_of, _mesh, rank_metas_of

    cfg = SimConfig(ranks=64, model="1b", tp=4, pp=2, shard_optimizer=True, chunk_mib=1)
    mesh, model = _mesh(cfg), Model.named(cfg.model)
    plan = plan_save(
        [rank_metas_of(model, mesh, cfg, r) for r in range(cfg.ranks)],
        ss.PlanOptions(chunk_bytes=1 << 20),
    )
    manifest = _manifest_of(plan, 1 << 20)
    monkeypatch.setattr(grid, "GRID_MIN_MANIFEST_CHUNKS", 1)
    doc = json.loads(manifest.to_json())
    grids = [t["grid"] for t in doc["tensors"].values() if "grid" in t]
    assert any(len(g[0]) > 2 and len(g[1]) > 2 for g in grids)  # both dimensions cut
    gridded = parse_manifest(manifest.to_json())
    monkeypatch.setattr(grid, "GRID_MIN_CHUNKS", 1 << 30)
    assert parse_manifest(manifest.to_json()).tensors == gridded.tensors

"""format/SPEC.md stays true: its worked example is a real manifest, and the fields it lists
for the manifest, the marker and the shard header are exactly those snapstate writes.

A field is documented by a bullet that opens with its backticked name (several names joined
by ", " or " and " share one bullet); a nested bullet is a field of the record above it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from snapstate.format import grid
from snapstate.format.manifest import parse_manifest
from snapstate.format.marker import LocalTensor, Marker, MarkerChunk, parse_marker
from snapstate.format.shard import ShardEntry, build_header, parse_header

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "src" / "snapstate" / "format" / "SPEC.md"
BULLET = re.compile(r"^( *)- ((?:`[^`]+`(?:, | and )?)+)")
NAME = re.compile(r"`([^`]+)`")
JSON_BLOCK = re.compile(r"^```json\n(.*?)^```", re.MULTILINE | re.DOTALL)

Fields = dict[str, "Fields"]


def section(heading: str) -> str:
    """The text under the ``## `` heading that starts with ``heading``, up to the next one."""
    text = SPEC.read_text()
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def documented(text: str) -> Fields:
    """The bulleted fields of a section, nested by indentation: name -> its own fields."""
    root: Fields = {}
    stack: list[tuple[int, Fields]] = [(-1, root)]
    for line in text.splitlines():
        bullet = BULLET.match(line)
        if bullet is None:
            continue
        depth = len(bullet.group(1))
        while stack[-1][0] >= depth:
            stack.pop()
        names = NAME.findall(bullet.group(2))
        children: Fields = {}
        for name in names:
            stack[-1][1][name] = children
        stack.append((depth, children))
    return root


def example_manifest() -> bytes:
    """The worked example as it lies on disk: the compact encoding of the indented block."""
    shown = JSON_BLOCK.findall(section("Worked example"))[0]
    return json.dumps(json.loads(shown), separators=(",", ":")).encode()


MANIFEST = documented(section("`manifest.json`"))
# the chunk fields of a compressed save only (SaveOptions(compression="zstd"), version 3)
CODEC_FIELDS = ("codec", "frames")
# the chunk field of an incremental save only (CheckpointManager(incremental=True))
DIGEST_FIELDS = ("digest",)
RAW_CHUNK = sorted(
    f for f in MANIFEST["tensors"]["chunks"] if f not in (*CODEC_FIELDS, *DIGEST_FIELDS)
)
# the tensor fields of the grid form only (a tensor of many chunks, version 5), not `chunks`
GRID_FIELDS = ("grid", "file", "start", "block_bytes", "xxh3")
LISTED_TENSOR = sorted(f for f in MANIFEST["tensors"] if f not in GRID_FIELDS)


def record_fields(doc: dict[str, Any]) -> dict[str, list[str]]:
    """The member names of each kind of record in a manifest document."""
    tensors = [*doc["tensors"].values()]
    tensors += [t for r in doc["rank_local"].values() for t in r["tensors"].values()]
    found = {
        "": list(doc),
        "tensors": sorted({f for t in tensors for f in t}),
        "chunks": sorted({f for t in tensors for c in t.get("chunks", ()) for f in c}),
        "files": sorted({f for rec in doc["files"].values() for f in rec}),
    }
    if doc["rank_local"]:
        found["rank_local"] = sorted({f for r in doc["rank_local"].values() for f in r})
    return found


def test_the_worked_example_is_a_valid_manifest() -> None:
    raw = example_manifest()
    manifest = parse_manifest(raw, file="SPEC.md")  # the checksum too: a real manifest
    assert manifest.to_json() == raw  # and byte for byte what the writer writes
    assert manifest.world_size == 2 and manifest.step == 100
    assert manifest.tensors["bias"].placement == "replicate"
    assert len(manifest.tensors["bias"].chunks) == 1
    table = manifest.tensors["table"]
    assert table.placement == "shard" and len({c.file for c in table.chunks}) == 2


def test_the_worked_example_has_exactly_the_documented_fields() -> None:
    found = record_fields(json.loads(example_manifest()))
    assert found[""] == list(MANIFEST), "SPEC.md lists other manifest members, or in another order"
    assert found["tensors"] == LISTED_TENSOR
    assert found["chunks"] == RAW_CHUNK
    assert found["files"] == sorted(MANIFEST["files"])


def test_a_save_today_writes_the_documented_fields(tmp_path: Path) -> None:
    state = {
        "bias": torch.arange(4.0),
        "table": torch.zeros(3, 2, dtype=torch.int64),
        "epoch": 3,
        "local": ss.RankLocal({"noise": torch.ones(2)}),
    }
    ss.save(state, tmp_path / "ck", step=100)
    found = record_fields(json.loads((tmp_path / "ck" / "manifest.json").read_bytes()))
    assert found[""] == list(MANIFEST)
    assert found["tensors"] == LISTED_TENSOR
    assert found["chunks"] == RAW_CHUNK
    assert found["files"] == sorted(MANIFEST["files"])
    assert found["rank_local"] == sorted(MANIFEST["rank_local"])


def test_a_compressed_save_writes_the_documented_codec_fields(tmp_path: Path) -> None:
    options = ss.SaveOptions(compression="zstd")
    ss.save({"w": torch.zeros(64, 16)}, tmp_path / "ck", options=options)
    found = record_fields(json.loads((tmp_path / "ck" / "manifest.json").read_bytes()))
    assert found["chunks"] == sorted([*RAW_CHUNK, *CODEC_FIELDS])


def test_an_incremental_save_writes_the_documented_digest_and_references(tmp_path: Path) -> None:
    state = {"frozen": torch.zeros(64, 16), "trained": torch.zeros(8)}
    with ss.CheckpointManager(tmp_path, incremental=True, async_save=False) as mgr:
        mgr.save(1, state)
        state["trained"] += 1
        mgr.save(2, state)
    doc = json.loads((tmp_path / "step-000000002" / "manifest.json").read_bytes())
    found = record_fields(doc)
    assert found[""] == list(MANIFEST) and doc["version"] == 4
    assert found["chunks"] == sorted([*RAW_CHUNK, *DIGEST_FIELDS])
    assert any(f.startswith("../step-000000001/") for f in doc["files"])
    assert "## References (version 4" in SPEC.read_text()


def test_a_grid_save_writes_the_documented_grid_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grid, "GRID_MIN_MANIFEST_CHUNKS", 1)  # grids in a small manifest
    options = ss.SaveOptions(plan=ss.PlanOptions(chunk_bytes=256))
    ss.save({"w": torch.zeros(64, 16)}, tmp_path / "ck", options=options)  # 16 chunks
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_bytes())
    assert doc["version"] == 5
    expected = sorted({*MANIFEST["tensors"]} - {"chunks"})
    assert record_fields(doc)["tensors"] == expected


def test_the_marker_fields_are_documented() -> None:
    file = "shards/r00000-000.safetensors"
    chunk = MarkerChunk("w", "replicate", file, "w@0", 64, 80, (0,), (4,), 4 << 20, ("0" * 16,))
    marker = Marker(
        rank=0,
        files={chunk.file: 80},
        chunks=(chunk,),
        kinds={"w": "tensor"},
        local_trees={"local": {"t": "x"}},
        local_tensors={"x": LocalTensor("float32", (2,), "tensor")},
        timings={"write_s": 0.1},
        tree={"d": []},
        replicas={"v@0": ("0" * 16,)},
    )
    raw = marker.to_json()
    assert parse_marker(raw, ".markers/r00000.json", rank=0) == marker
    doc = json.loads(raw)
    fields = documented(section("Markers"))
    assert list(doc) == list(fields), "SPEC.md lists other marker members, or in another order"
    assert sorted(doc["chunks"][0]) == sorted(fields["chunks"])
    assert sorted(doc["rank_local"]) == sorted(fields["rank_local"])


def test_the_shard_header_fields_are_documented() -> None:
    header, _ = build_header([ShardEntry("w@0", "F32", [4], 16)], {"format": "snapstate/1"})
    doc = json.loads(header[8:])
    fields = documented(section("Shard files"))
    assert list(fields) == ["__metadata__", "<name>"]
    assert list(doc) == ["__metadata__", "w@0"] and doc["__metadata__"] == {"format": "snapstate/1"}
    assert list(doc["w@0"]) == list(fields["<name>"])


def test_the_example_shard_header_matches_the_example_manifest() -> None:
    text = JSON_BLOCK.findall(section("Worked example"))[1].strip().encode()
    size = 184  # as the page says: the data of r00001 starts at 8 + 184
    assert len(text) <= size and (8 + size) % 64 == 0
    manifest = parse_manifest(example_manifest())
    path = "shards/r00001-000.safetensors"
    prefix = struct.pack("<Q", size) + text.ljust(size)
    parsed = parse_header(prefix, manifest.files[path].bytes, path)
    chunks = [c for t in manifest.tensors.values() for c in t.chunks if c.file == path]
    assert {c.name: (c.start, c.end) for c in chunks} == {
        name: (begin, end) for name, (_, _, begin, end) in parsed.entries.items()
    }

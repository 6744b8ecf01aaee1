"""The per-rank marker: a typed record that round-trips and refuses malformed input."""

from __future__ import annotations

import json

import pytest

from snapstate.errors import CorruptCheckpointError
from snapstate.format.marker import LocalTensor, Marker, MarkerChunk, parse_marker


def _marker() -> Marker:
    chunk = MarkerChunk(
        "w",
        "shard",
        "shards/r00000-000.safetensors",
        "w@0,0",
        64,
        96,
        (0, 0),
        (2, 4),
        1 << 20,
        ("0123456789abcdef",),
    )
    return Marker(
        rank=1,
        files={"shards/r00000-000.safetensors": 96},
        chunks=(chunk,),
        kinds={"w": "tensor"},
        local_trees={"rng": {"v": 1}},
        local_tensors={"rng/x": LocalTensor("uint8", (4,), "tensor")},
        timings={"blocking_s": 0.5},
        tree={"d": []},
        replicas={"v@0": ("aa", "bb")},
    )


def test_marker_round_trips() -> None:
    m = _marker()
    assert parse_marker(m.to_json(), "r1.json", rank=1) == m


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("chunks"), "chunks is not a list"),
        (lambda d: d.update(rank=2), "marker of rank 2, expected 1"),
        (lambda d: d.update(format="other"), "not a snapstate-marker"),
        (lambda d: d["chunks"][0].update(start="64"), "is not an integer"),
        (lambda d: d["chunks"][0].update(end=1), "chunk ends before it starts"),
        (lambda d: d["chunks"][0].update(placement="mirror"), "unknown placement"),
        (lambda d: d["chunks"][0].update(offsets=[0]), "offsets and sizes differ"),
        (lambda d: d["files"].update(x=-1), "is not an integer"),
        (lambda d: d.update(replicas={"v@0": "ab"}), "is not a list"),
        (lambda d: d["rank_local"].pop("tensors"), "rank_local.tensors is not an object"),
    ],
)
def test_malformed_marker_is_a_corrupt_checkpoint_error(edit, message) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(_marker().to_json())
    edit(doc)
    with pytest.raises(CorruptCheckpointError, match=message) as err:
        parse_marker(json.dumps(doc).encode(), "r1.json", rank=1)
    assert err.value.file == "r1.json"


def test_torn_marker_is_a_corrupt_checkpoint_error() -> None:
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        parse_marker(_marker().to_json()[:40], "r1.json", rank=1)

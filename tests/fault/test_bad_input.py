"""Bad input: each damage to a checkpoint is a clear CheckpointError naming the file and the key,
raised before anything large is allocated or read, and nothing of the target is half-loaded."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss

from .corrupt import (
    SHARD,
    SMALL_OPTIONS,
    blank_small_state,
    chunk,
    edit_manifest,
    flip_byte,
    read_header,
    read_manifest,
    rewrite_header,
    set_header_size,
    small_state,
    watch_allocations,
    write_header_bytes,
)

Reader = Callable[[Path], Any]
READERS: dict[str, Reader] = {
    "load": lambda p: ss.load(blank_small_state(), p),
    "verify": ss.verify,
    "inspect": ss.inspect,
}
DATA_READERS = ("load", "verify")  # the readers that touch tensor bytes


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    ss.save(small_state(), path, options=SMALL_OPTIONS)
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def expect(
    ckpt: Path, error: type[Exception], *fragments: str, readers: tuple[str, ...] = tuple(READERS)
) -> None:
    """Every reader raises ``error`` with a message holding every fragment (file, key, reason)."""
    for name in readers:
        with pytest.raises(error) as info:
            READERS[name](ckpt)
        for fragment in fragments:
            assert fragment in str(info.value), f"{name}: {fragment!r} not in {str(info.value)!r}"


def test_pristine_checkpoint_reads(ckpt: Path) -> None:
    target = blank_small_state()
    ss.load(target, ckpt)
    assert torch.equal(target["model"]["w"], small_state()["model"]["w"])
    assert ss.verify(ckpt).chunks == 5


# -- missing things ------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    expect(tmp_path / "nowhere", ss.CheckpointNotFoundError, "nowhere")


def test_directory_without_manifest_is_not_committed(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()
    expect(ckpt, ss.CheckpointNotFoundError, "not committed")


def test_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    expect(tmp_path / "file", ss.CheckpointNotFoundError, "file")


def test_missing_shard(ckpt: Path) -> None:
    (ckpt / SHARD).unlink()
    expect(ckpt, ss.CorruptCheckpointError, SHARD, "missing", "model/w")


def test_truncated_shard(ckpt: Path) -> None:
    os.truncate(ckpt / SHARD, os.path.getsize(ckpt / SHARD) - 100)
    expect(ckpt, ss.CorruptCheckpointError, SHARD, "model/w")


def test_truncated_shard_with_manifest_to_match(ckpt: Path) -> None:
    size = os.path.getsize(ckpt / SHARD) - 100
    os.truncate(ckpt / SHARD, size)
    edit_manifest(ckpt, lambda d: d["files"][SHARD].update(bytes=size))
    last = max(read_manifest(ckpt)["tensors"].items(), key=lambda kv: kv[1]["chunks"][0]["end"])[0]
    expect(ckpt, ss.CorruptCheckpointError, SHARD, last, "beyond")


def test_manifest_that_is_a_directory(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").mkdir()
    expect(ckpt, ss.CheckpointError, "manifest.json")


def test_shard_that_is_a_directory(ckpt: Path) -> None:
    (ckpt / SHARD).unlink()
    (ckpt / SHARD).mkdir()
    expect(ckpt, ss.CorruptCheckpointError, SHARD)


# -- flipped bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["model/w", "model/b", "opt/step", "opt/ids", "arr"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_tensor_data(ckpt: Path, key: str, where: str) -> None:
    c = chunk(read_manifest(ckpt), key)
    offset = {"first": c["start"], "middle": (c["start"] + c["end"]) // 2, "last": c["end"] - 1}[
        where
    ]
    flip_byte(ckpt / SHARD, offset)
    for name in DATA_READERS:
        with pytest.raises(ss.CorruptCheckpointError) as info:
            READERS[name](ckpt)
        assert (info.value.file, info.value.key) == (SHARD, key)
        assert SHARD in str(info.value) and key in str(info.value) and "checksum" in str(info.value)
    assert ss.inspect(ckpt).tensors[key]  # the manifest itself is fine


def test_flipped_byte_leaves_other_keys_loadable(ckpt: Path) -> None:
    """Loading is by target: a target without the damaged key loads, and exactly."""
    flip_byte(ckpt / SHARD, chunk(read_manifest(ckpt), "opt/ids")["start"])
    target = {"model": {k: torch.zeros_like(v) for k, v in small_state()["model"].items()}}
    ss.load(target, ckpt)
    assert torch.equal(target["model"]["w"], small_state()["model"]["w"])


def test_flipped_byte_in_shard_header(ckpt: Path) -> None:
    """Any flipped byte of the header is caught by verify, except in the free-form metadata."""
    raw = (ckpt / SHARD).read_bytes()
    _, size = read_header(ckpt / SHARD)
    metadata = b'{"format":"snapstate/1"}'
    free = raw.index(metadata)  # inside the __metadata__ object, safetensors allows any strings
    for offset in range(8 + size):
        if free < offset < free + len(metadata) - 1:
            continue
        flip_byte(ckpt / SHARD, offset)
        expect(ckpt, ss.CorruptCheckpointError, SHARD, readers=("verify",))
        (ckpt / SHARD).write_bytes(raw)


# -- manifest: paths, ranges, sizes --------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_path",
    [
        "/etc/passwd",
        "../outside.safetensors",
        "shards/../../outside.safetensors",
        "shards\\r00000-000.safetensors",
        "./shards/r00000-000.safetensors",
        "shards//r00000-000.safetensors",
        "",
        ".",
        "shards/",
        "a\x00b",
    ],
)
def test_manifest_path_outside_checkpoint(ckpt: Path, bad_path: str) -> None:
    (ckpt.parent / "outside.safetensors").write_bytes((ckpt / SHARD).read_bytes())

    def retarget(doc: dict[str, Any]) -> None:
        doc["files"] = {bad_path: doc["files"][SHARD]}
        for rec in doc["tensors"].values():
            for c in rec["chunks"]:
                c["file"] = bad_path

    edit_manifest(ckpt, retarget)
    expect(ckpt, ss.CorruptCheckpointError, "outside the checkpoint", "manifest.json")


def test_chunk_file_not_listed(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: chunk(d, "model/b").update(file="shards/other.safetensors"))
    expect(ckpt, ss.CorruptCheckpointError, "not listed", "model/b")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("offsets", [1, 0]),
        ("offsets", [0, 1]),
        ("sizes", [65, 32]),
        ("sizes", [64, 33]),
        ("offsets", [-1, 0]),
        ("offsets", [0]),
        ("sizes", [64, 32, 1]),
        ("offsets", [0.0, 0]),
        ("sizes", [True, 32]),
        ("offsets", "0,0"),
    ],
)
def test_chunk_box_beyond_shape(ckpt: Path, field: str, value: Any) -> None:
    edit_manifest(ckpt, lambda d: chunk(d, "model/w").update({field: value}))
    expect(ckpt, ss.CorruptCheckpointError, "model/w", "manifest.json")


@pytest.mark.parametrize(
    "change",
    [
        {"start": 10**6, "end": 10**6 + 128},
        {"end": "shift+4"},
        {"start": -128, "end": 0},
        {"start": 2**63, "end": 2**63 + 128},
    ],
)
def test_chunk_byte_range_beyond_file(ckpt: Path, change: dict[str, Any]) -> None:
    def edit(doc: dict[str, Any]) -> None:
        c = chunk(doc, "model/b")
        for k, v in change.items():
            c[k] = c[k] + int(v.split("+")[1]) if isinstance(v, str) else v

    edit_manifest(ckpt, edit)
    expect(ckpt, ss.CorruptCheckpointError, "model/b", "manifest.json")


def test_chunk_byte_range_shifted_inside_file(ckpt: Path) -> None:
    """A range that stays inside the file but is not the tensor's: the checksums catch it."""
    edit_manifest(
        ckpt,
        lambda d: chunk(d, "model/b").update(
            start=chunk(d, "model/b")["start"] + 4, end=chunk(d, "model/b")["end"] + 4
        ),
    )
    expect(ckpt, ss.CorruptCheckpointError, SHARD, "model/b", readers=DATA_READERS)


def test_recorded_file_size_beyond_real_file(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d["files"][SHARD].update(bytes=d["files"][SHARD]["bytes"] + 4096))
    expect(ckpt, ss.CorruptCheckpointError, SHARD, "bytes")


def test_checksum_count_mismatch(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: chunk(d, "model/w").update(xxh3=chunk(d, "model/w")["xxh3"][:-1]))
    expect(ckpt, ss.CorruptCheckpointError, "model/w", "checksums")


def test_chunks_that_do_not_tile(ckpt: Path) -> None:
    def overlap(doc: dict[str, Any]) -> None:
        c = chunk(doc, "model/w")
        half = {**c, "sizes": [32, 32], "end": c["start"] + 32 * 32 * 4, "xxh3": c["xxh3"][:4]}
        doc["tensors"]["model/w"]["chunks"] = [half, dict(half)]  # twice the same top half

    edit_manifest(ckpt, overlap)
    expect(ckpt, ss.CorruptCheckpointError, "model/w", "overlap")


# -- sizes that would allocate more than the file holds ------------------------------------------


def _huge(doc: dict[str, Any]) -> None:
    rec = doc["tensors"]["model/b"]
    rec["shape"] = [10**12]
    c = rec["chunks"][0]
    c.update(
        offsets=[0],
        sizes=[10**12],
        end=c["start"] + 4 * 10**12,
        block_bytes=4 * 10**12,
        xxh3=["0" * 16],
    )


def _huge_recorded(doc: dict[str, Any]) -> None:
    """The same, with the recorded file size raised to match: only the real file disagrees."""
    rec = doc["tensors"]["model/b"]
    rec["shape"] = [10**9]
    c = rec["chunks"][0]
    c.update(
        offsets=[0],
        sizes=[10**9],
        end=c["start"] + 4 * 10**9,
        block_bytes=4 * 10**9,
        xxh3=["0" * 16],
    )
    doc["files"][SHARD]["bytes"] = c["end"]


def _repeated_bytes(doc: dict[str, Any]) -> None:
    """Many chunks reading the same bytes: each fits the file, together they hold 1000x more."""
    rec = doc["tensors"]["model/b"]
    c = rec["chunks"][0]
    rec["shape"] = [32 * 1000]
    rec["chunks"] = [{**c, "offsets": [32 * i]} for i in range(1000)]


def _astronomic(doc: dict[str, Any]) -> None:
    rec = doc["tensors"]["model/b"]
    rec["shape"] = [10**30, 0]
    rec["chunks"][0].update(offsets=[0, 0], sizes=[10**30, 0], end=rec["chunks"][0]["start"])


@pytest.mark.parametrize("edit", [_huge, _huge_recorded, _repeated_bytes, _astronomic])
def test_size_beyond_file_fails_before_allocating(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, edit: Callable[[dict[str, Any]], None]
) -> None:
    edit_manifest(ckpt, edit)
    target = blank_small_state()
    target["model"]["b"] = None  # a plain slot: load would allocate what the manifest says
    for name, reader in {**READERS, "load": lambda p: ss.load(target, p)}.items():
        with (
            watch_allocations(monkeypatch) as seen,
            pytest.raises(ss.CorruptCheckpointError) as info,
        ):
            reader(ckpt)
        assert "model/b" in str(info.value) or SHARD in str(info.value), str(info.value)
        assert seen.largest_tensor < 1 << 20 and seen.largest_read < 1 << 20, (name, vars(seen))
        assert seen.rss_growth < 16 << 20, (name, vars(seen))


def test_shape_with_dimension_too_large_for_torch(ckpt: Path) -> None:
    edit_manifest(ckpt, _astronomic)
    expect(ckpt, ss.CorruptCheckpointError, "model/b")


# -- manifest: dtype, format, JSON ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float33", "F32", "", 5, None, ["float32"], "torch.float32"])
def test_unknown_dtype(ckpt: Path, dtype: Any) -> None:
    edit_manifest(ckpt, lambda d: d["tensors"]["model/w"].update(dtype=dtype))
    expect(ckpt, ss.CorruptCheckpointError, "unknown dtype", "model/w", "manifest.json")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("format", "orbax"),
        ("format", None),
        ("version", 99),
        ("version", "1"),
        ("version", 0),
        ("version", None),
        ("version", 1.0),
        ("version", True),
    ],
)
def test_wrong_format_or_version(ckpt: Path, field: str, value: Any) -> None:
    edit_manifest(ckpt, lambda d: d.update({field: value}))
    expect(
        ckpt, ss.UnsupportedFormatError, "manifest.json", field if field == "format" else "version"
    )


def test_missing_version(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda d: d.pop("version"))
    expect(ckpt, ss.UnsupportedFormatError, "version")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"\xff\xfe{}",
        b"[]",
        b"null",
        b"42",
        b'"manifest"',
        b"[" * 100_000,
        b"{}" + b"x",
        b'{"format": "snapstate", "version": 1, "step": ' + b"9" * 5000 + b"}",
        b'{"format": "snapstate", "version": 1, "step": NaN}',
    ],
)
def test_manifest_not_valid_json(ckpt: Path, raw: bytes) -> None:
    (ckpt / "manifest.json").write_bytes(raw)
    expect(ckpt, ss.CorruptCheckpointError, "manifest.json")


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_truncated_manifest(ckpt: Path, fraction: float) -> None:
    raw = (ckpt / "manifest.json").read_bytes()
    (ckpt / "manifest.json").write_bytes(raw[: int(len(raw) * fraction)])
    expect(ckpt, ss.CorruptCheckpointError, "manifest.json", "JSON")


@pytest.mark.parametrize(
    "tree",
    [
        [],
        {"d": "x"},
        {"d": [["a"]]},
        {"d": [[["a"], {"v": 1}]]},
        {"d": [["model", 5]]},
        {"l": {"v": 1}},
        {"d": [["meta", {"f": "one"}]]},
        {"d": [["model", {"t": 5}]]},
        {"d": [["model", {"s": []}]]},
        {"zz": 1},
        {"d": [["model", {"d": [["w", {"t": "model/w"}], ["b", {"t": "no/such/key"}]]}]]},
    ],
)
def test_malformed_tree(ckpt: Path, tree: Any) -> None:
    edit_manifest(ckpt, lambda d: d.update(tree=tree))
    expect(ckpt, ss.CheckpointError, readers=("load",))


@pytest.mark.parametrize("rank", ["²", "-1", "1", "x", "01"])
def test_bad_rank_local_rank(ckpt: Path, rank: str) -> None:
    edit_manifest(ckpt, lambda d: d["rank_local"].update({rank: {"trees": {}, "tensors": {}}}))
    expect(ckpt, ss.CorruptCheckpointError, "rank")


# -- shard headers -------------------------------------------------------------------------------


def test_shard_header_not_json(ckpt: Path) -> None:
    _, size = read_header(ckpt / SHARD)
    write_header_bytes(ckpt / SHARD, b"\x00" * size)
    expect(ckpt, ss.CorruptCheckpointError, SHARD, "JSON", "model/w", readers=("verify",))


def test_shard_header_not_an_object(ckpt: Path) -> None:
    _, size = read_header(ckpt / SHARD)
    write_header_bytes(ckpt / SHARD, b"[]" + b" " * (size - 2))
    expect(ckpt, ss.CorruptCheckpointError, SHARD, readers=("verify",))


@pytest.mark.parametrize("size", [200 << 20, 1 << 62, 2**64 - 1])
def test_shard_header_size_over_cap(ckpt: Path, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    set_header_size(ckpt / SHARD, size)
    with watch_allocations(monkeypatch) as seen:
        expect(ckpt, ss.CorruptCheckpointError, SHARD, "header size", readers=("verify",))
    assert seen.largest_read < 1 << 20


def test_shard_header_size_beyond_file(ckpt: Path) -> None:
    set_header_size(ckpt / SHARD, os.path.getsize(ckpt / SHARD))
    expect(ckpt, ss.CorruptCheckpointError, SHARD, "header size", readers=("verify",))


def test_shard_shorter_than_header_size_field(ckpt: Path) -> None:
    os.truncate(ckpt / SHARD, 4)
    edit_manifest(ckpt, lambda d: d["files"][SHARD].update(bytes=4))
    expect(ckpt, ss.CorruptCheckpointError, SHARD)


def _shift_entry(header: dict[str, Any], by: int) -> None:
    name = next(k for k in header if k.startswith("model/b@"))
    header[name]["data_offsets"] = [
        header[name]["data_offsets"][0] + by,
        header[name]["data_offsets"][1] + by,
    ]


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: _shift_entry(h, 8),
        lambda h: _shift_entry(h, -8),
        lambda h: h.pop(next(k for k in h if k.startswith("opt/ids@"))),
    ],
)
def test_shard_buffer_with_holes(ckpt: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    rewrite_header(ckpt / SHARD, edit)
    expect(ckpt, ss.CorruptCheckpointError, SHARD, readers=("verify",))


def test_shard_header_disagrees_with_manifest(ckpt: Path) -> None:
    def rename(header: dict[str, Any]) -> None:
        name = next(k for k in header if k.startswith("model/b@"))
        header["model/c" + name[len("model/b") :]] = header.pop(name)

    rewrite_header(ckpt / SHARD, rename)
    expect(ckpt, ss.CorruptCheckpointError, SHARD, "model/b", "disagrees", readers=("verify",))


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": 5},
        {"shape": [-1]},
        {"data_offsets": [0]},
        {"data_offsets": [10, 5]},
        {"data_offsets": [0, 10**9]},
        "x",
    ],
)
def test_shard_header_entry_malformed(ckpt: Path, entry: Any) -> None:
    def edit(header: dict[str, Any]) -> None:
        name = next(k for k in header if k.startswith("model/w@"))
        header[name] = {**header[name], **entry} if isinstance(entry, dict) else entry

    rewrite_header(ckpt / SHARD, edit)
    expect(ckpt, ss.CorruptCheckpointError, SHARD, "model/w", readers=("verify",))


def test_cli_verify_reports_corruption(ckpt: Path) -> None:
    from click.testing import CliRunner

    from snapstate.cli import main

    flip_byte(ckpt / SHARD, chunk(read_manifest(ckpt), "model/w")["start"])
    result = CliRunner().invoke(main, ["verify", str(ckpt)])
    assert result.exit_code == 1
    assert SHARD in result.output and "model/w" in result.output

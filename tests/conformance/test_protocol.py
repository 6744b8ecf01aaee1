"""The Storage Protocol, operation by operation, on every backend."""

from __future__ import annotations

import os

import pytest

from snapstate.storage.base import FileWriter, Storage

from .conftest import Backend


def payload(n: int, seed: int = 7) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n)) if n < 4096 else os.urandom(n)


def write_file(storage: Storage, path: str, data: bytes, piece: int = 1000) -> None:
    writer = storage.open_writer(path, len(data))
    view = memoryview(data)
    for offset in range(0, len(data), piece):
        writer.write_at(view[offset : offset + piece], offset)
    writer.close(sync=True)


def test_is_a_storage(backend: Backend) -> None:
    storage = backend.storage("s")
    assert isinstance(storage, Storage)
    writer = storage.open_writer("f", 0)
    assert isinstance(writer, FileWriter)
    writer.close()
    assert storage.size("f") == 0


def test_written_file_reads_back_whole_and_in_ranges(backend: Backend) -> None:
    storage = backend.storage("rw")
    data = payload(5000)
    write_file(storage, "shards/a.bin", data)
    assert storage.exists("shards/a.bin") and storage.size("shards/a.bin") == len(data)
    assert storage.read_bytes("shards/a.bin") == data
    assert storage.read_bytes("shards/a.bin", 100, 250) == data[100:350]
    assert storage.read_bytes("shards/a.bin", 4900) == data[4900:]
    out = bytearray(777)
    storage.read_into("shards/a.bin", 1234, memoryview(out))
    assert bytes(out) == data[1234 : 1234 + 777]


def test_empty_reads_are_empty(backend: Backend) -> None:
    # S3 answers an empty Range with the whole object: the backend must not pass that through.
    storage = backend.storage("empty")
    write_file(storage, "f", payload(64))
    assert storage.read_bytes("f", 8, 0) == b""
    assert storage.read_bytes("f", 64) == b""
    storage.read_into("f", 10, memoryview(bytearray(0)))
    write_file(storage, "zero", b"")
    assert (
        storage.exists("zero") and storage.size("zero") == 0 and storage.read_bytes("zero") == b""
    )


def test_reads_past_the_end_and_of_missing_files_fail_clearly(backend: Backend) -> None:
    storage = backend.storage("eof")
    write_file(storage, "f", payload(100))
    with pytest.raises(EOFError):
        storage.read_into("f", 90, memoryview(bytearray(20)))
    with pytest.raises(EOFError):
        storage.read_into("f", 100, memoryview(bytearray(1)))
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("missing")
    with pytest.raises(FileNotFoundError):
        storage.read_into("missing", 0, memoryview(bytearray(4)))
    with pytest.raises(FileNotFoundError):
        storage.size("missing")
    assert not storage.exists("missing")


def test_writer_order(backend: Backend) -> None:
    """Sequential writers reject a gap clearly; positional ones place bytes where asked."""
    storage = backend.storage("order")
    data = payload(300)
    writer = storage.open_writer("f", len(data))
    writer.write_at(memoryview(data)[:100], 0)
    if writer.sequential:
        with pytest.raises(ValueError, match="byte 200.*byte 100"):
            writer.write_at(memoryview(data)[200:], 200)
        writer.abort()
        assert not storage.exists("f")
    else:
        writer.write_at(memoryview(data)[200:], 200)
        writer.write_at(memoryview(data)[100:200], 100)
        writer.close()
        assert storage.read_bytes("f") == data


def test_aborted_writer_leaves_no_file(backend: Backend) -> None:
    storage = backend.storage("abort")
    writer = storage.open_writer("shards/f", 10 << 20)
    writer.write_at(memoryview(payload(6 << 20)), 0)  # past one S3 part: a multipart upload is open
    writer.abort()
    assert not storage.exists("shards/f")
    assert "f" not in storage.listdir("shards")


def test_large_file_in_many_pieces(backend: Backend) -> None:
    storage = backend.storage("large")
    data = payload(11 << 20)
    write_file(storage, "big", data, piece=1 << 20)
    assert storage.size("big") == len(data)
    assert storage.read_bytes("big", (5 << 20) - 10, 20) == data[(5 << 20) - 10 : (5 << 20) + 10]
    out = bytearray(len(data))
    storage.read_into("big", 0, memoryview(out))
    assert out == data


def test_listdir_names_children_only(backend: Backend) -> None:
    storage = backend.storage("ls")
    for path in ["a", "d/x", "d/y", "d/sub/z", "step-1/m", "step-10/m"]:
        storage.write_atomic(path, b"1")
    assert storage.listdir() == ["a", "d", "step-1", "step-10"]
    assert storage.listdir("d") == ["sub", "x", "y"]
    assert storage.listdir("nowhere") == []
    assert storage.listdir("a") == []
    assert storage.exists("d") and storage.exists("d/sub")  # a directory (a prefix) with files
    assert not storage.exists("ste") and not storage.exists("step-1/m/x")  # no prefix match


def test_write_atomic_replaces_whole_content(backend: Backend) -> None:
    storage = backend.storage("atomic")
    storage.write_atomic("dir/manifest.json", b'{"v": 1, "long": "' + b"x" * 1000 + b'"}')
    storage.write_atomic("dir/manifest.json", b'{"v": 2}')
    assert storage.read_bytes("dir/manifest.json") == b'{"v": 2}'
    assert storage.listdir("dir") == ["manifest.json"]  # no temporary file left behind


def test_remove_and_remove_tree(backend: Backend) -> None:
    storage = backend.storage("rm")
    for path in ["step-1/manifest.json", "step-1/shards/a", "step-10/manifest.json", "keep"]:
        storage.write_atomic(path, b"x")
    storage.remove("step-1/manifest.json")
    storage.remove("step-1/manifest.json")  # removing what is gone is not an error
    assert not storage.exists("step-1/manifest.json") and storage.exists("step-1/shards/a")
    storage.remove_tree("step-1")
    storage.remove_tree("never-existed")
    assert not storage.exists("step-1/shards/a")
    assert storage.listdir() == ["keep", "step-10"]  # a sibling sharing the prefix survives
    storage.remove_tree()
    assert storage.listdir() == [] and not storage.exists("keep")


def test_child_is_the_same_place(backend: Backend) -> None:
    storage = backend.storage("parent")
    storage.makedirs("step-5")
    child = storage.child("step-5")
    child.makedirs("shards")
    write_file(child, "shards/f", payload(10))
    child.sync_dir("shards")
    child.sync_dir()
    assert storage.read_bytes("step-5/shards/f") == payload(10)
    assert child.root.rstrip("/").endswith("step-5")
    assert storage.listdir("step-5") == ["shards"]

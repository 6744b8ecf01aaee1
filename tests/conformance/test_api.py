"""The public API end to end on every backend: round trips, commit, partial reads, corruption."""

from __future__ import annotations

import json

import pytest
import torch

import snapstate as ss
from snapstate.format.manifest import MANIFEST
from support.states import assert_same_state, tensors_of, training_state
from support.storages import CountingStorage, Fault, FaultyStorage

from .conftest import Backend


def test_save_load_round_trip_is_bitwise(backend: Backend) -> None:
    saved = training_state(seed=0)
    result = ss.save(saved, backend.target("ckpt"), step=7)
    assert result.step == 7 and result.bytes_written > 0
    restored = training_state(seed=1)
    ss.load(restored, backend.target("ckpt"))
    assert_same_state(saved, restored)


def test_async_save_keeps_the_values_of_the_call(backend: Backend) -> None:
    state = training_state(seed=0)
    expected = {k: v.clone() for k, v in tensors_of(state).items()}
    handle = ss.async_save(state, backend.target("ckpt"))
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)  # training goes on while the save persists
    handle.wait()
    assert handle.done()
    restored = training_state(seed=1)
    ss.load(restored, backend.target("ckpt"))
    for key, tensor in tensors_of(restored).items():
        assert torch.equal(tensor, expected[key]), key


def test_many_files_threads_and_pieces(backend: Backend) -> None:
    """Several shard files, several writer threads, small pieces: every write is in file order."""
    state = training_state(seed=2, width=64)
    options = ss.SaveOptions(
        threads=3, piece_bytes=1024, plan=ss.PlanOptions(max_file_bytes=8 << 10)
    )
    ss.save(state, backend.target("ckpt"), options=options)
    manifest = ss.inspect(backend.target("ckpt"))
    assert len(manifest.files) >= 3
    restored = training_state(seed=3, width=64)
    ss.load(restored, backend.target("ckpt"))
    assert_same_state(state, restored)


def test_verify_and_inspect(backend: Backend) -> None:
    state = training_state()
    ss.save(state, backend.target("ckpt"), step=3)
    report = ss.verify(backend.target("ckpt"))
    assert report.ok and report.files >= 1
    manifest = ss.inspect(backend.target("ckpt"))
    assert report.bytes_checked == manifest.totals["tensor_bytes"]
    assert report.bytes_checked >= sum(
        t.numel() * t.element_size() for t in tensors_of(state).values()
    )
    assert manifest.step == 3 and "model/0.weight" in manifest.tensors
    assert backend.storage("ckpt").listdir() == ["manifest.json", "shards"]  # markers are gone


def test_overwrite_replaces_a_committed_checkpoint(backend: Backend) -> None:
    ss.save(training_state(seed=0), backend.target("ckpt"))
    with pytest.raises(ss.CheckpointExistsError):
        ss.save(training_state(seed=1), backend.target("ckpt"))
    newer = training_state(seed=1)
    ss.save(newer, backend.target("ckpt"), overwrite=True)
    restored = training_state(seed=2)
    ss.load(restored, backend.target("ckpt"))
    assert_same_state(newer, restored)


def test_partial_load_reads_only_the_needed_bytes(backend: Backend) -> None:
    big = {
        "model": torch.randn(256, 64),
        "optim": torch.randn(1024, 64),
        "head": torch.randn(16, 16),
    }
    ss.save(big, backend.target("ckpt"))
    counting = CountingStorage(backend.storage("ckpt"))
    target = {"head": torch.zeros(16, 16)}
    result = ss.load(target, counting)
    assert torch.equal(target["head"], big["head"])
    assert sum(counting.data_reads.values()) == 16 * 16 * 4 == result.bytes_read
    manifest_bytes = counting.inner.size(MANIFEST)
    # no shard was read whole: the manifest, and the header of the shard that holds "head"
    (chunk,) = ss.inspect(counting.inner).tensors["head"].chunks
    header = 8 + int.from_bytes(counting.inner.read_bytes(chunk.file, 0, 8), "little")
    assert counting.small_reads == {MANIFEST: manifest_bytes, chunk.file: header}


def test_uncommitted_checkpoint_is_invisible(backend: Backend) -> None:
    ss.save(training_state(), backend.target("ckpt"))
    backend.storage("ckpt").remove(MANIFEST)  # shards are all there, the commit point is not
    with pytest.raises(ss.CheckpointNotFoundError, match="not committed"):
        ss.load(training_state(seed=1), backend.target("ckpt"))
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.inspect(backend.target("ckpt"))
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.verify(backend.target("ckpt"))
    with pytest.raises(ss.CheckpointNotFoundError, match="no such directory"):
        ss.inspect(backend.target("never-saved"))


def test_torn_save_commits_nothing(backend: Backend) -> None:
    state = training_state(width=64)
    with pytest.raises(OSError, match="injected"):
        ss.save(
            state, FaultyStorage(backend.storage("ckpt"), Fault("write_data", after_bytes=4096))
        )
    storage = backend.storage("ckpt")
    assert not storage.exists(MANIFEST)
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.inspect(backend.target("ckpt"))
    ss.save(state, backend.target("ckpt"))  # the leftovers do not block the next save
    assert ss.verify(backend.target("ckpt")).ok


def _shard(backend: Backend) -> tuple[str, int]:
    manifest = ss.inspect(backend.target("ckpt"))
    chunk = manifest.tensors["model/0.weight"].chunks[0]
    return chunk.file, (chunk.start + chunk.end) // 2


def test_flipped_byte_is_reported_as_corrupt(backend: Backend) -> None:
    ss.save(training_state(), backend.target("ckpt"))
    path, where = _shard(backend)
    storage = backend.storage("ckpt")
    data = bytearray(storage.read_bytes(path))
    data[where] ^= 0x40
    storage.write_atomic(path, bytes(data))  # same size: only the checksums can tell
    with pytest.raises(ss.CorruptCheckpointError, match="checksum") as info:
        ss.verify(backend.target("ckpt"))
    assert info.value.file == path and info.value.key == "model/0.weight"
    with pytest.raises(ss.CorruptCheckpointError, match="checksum"):
        ss.load(training_state(seed=1), backend.target("ckpt"))


def test_truncated_object_and_bad_manifest_are_corrupt(backend: Backend) -> None:
    ss.save(training_state(), backend.target("ckpt"))
    path, where = _shard(backend)
    storage = backend.storage("ckpt")
    storage.write_atomic(path, storage.read_bytes(path, 0, where))
    with pytest.raises(ss.CorruptCheckpointError, match="bytes, the manifest says"):
        ss.load(training_state(seed=1), backend.target("ckpt"))
    storage.write_atomic(MANIFEST, json.dumps({"format": "snapstate/1", "tensors": 5}).encode())
    with pytest.raises(ss.CorruptCheckpointError):
        ss.inspect(backend.target("ckpt"))
    storage.write_atomic(MANIFEST, b"\x00not json")
    with pytest.raises(ss.CorruptCheckpointError):
        ss.verify(backend.target("ckpt"))


def test_resharding_read_fetches_only_the_covering_blocks(backend: Backend) -> None:
    """A target holding rows 300..340 of a stored chunk reads the checksum blocks around them."""
    from snapstate.engine.load import ReadTask, read_one
    from snapstate.planning.items import Box

    weight = torch.randn(1000, 64)  # rows of 256 bytes, 4 KiB blocks of 16 rows
    ss.save({"w": weight}, backend.target("ckpt"), options=ss.SaveOptions(block_bytes=4096))
    record = ss.inspect(backend.target("ckpt")).tensors["w"]
    (chunk,) = record.chunks
    target = torch.zeros(40, 64)
    counting = CountingStorage(backend.storage("ckpt"))
    got = read_one(counting, ReadTask("w", record, chunk, Box((300, 0), (40, 64)), target))
    assert torch.equal(target, weight[300:340])
    # bytes 76800..87040 lie in blocks 18..21 (of 63): four blocks, not the 256000-byte chunk
    assert got == sum(counting.data_reads.values()) == 4 * 4096

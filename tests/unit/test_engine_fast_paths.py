"""The engine's fast paths keep behaviour: parallel staging copies, held writes, hashing threads.

Each path is taken with tensors large enough to use it (several copy segments, several
pieces per chunk) and checked bitwise, including values changed right after ``async_save``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.engine import staging
from snapstate.format.dtypes import empty_bytes
from support.bits import assert_bitwise_equal
from support.states import blank_like
from support.tensors import random_tensor

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_save_left_in_flight() -> Iterator[None]:
    yield
    ss.api.wait_for_pending()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.float8_e4m3fn]
)
def test_copy_bytes_is_bitwise_over_several_segments(dtype: torch.dtype) -> None:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = (2 * staging.COPY_SEGMENT_BYTES + 3 * itemsize) // itemsize  # a ragged last segment
    src = random_tensor(dtype, (n,), seed=1)
    dst = torch.empty_like(src)
    staging.copy_bytes(dst, src)
    assert_bitwise_equal(dst, src)


def test_copy_bytes_of_a_small_tensor() -> None:
    src = torch.arange(10, dtype=torch.int64)
    dst = torch.zeros_like(src)
    staging.copy_bytes(dst, src)
    assert torch.equal(dst, src)


def large_state() -> dict[str, torch.Tensor]:
    """Chunks of several copy segments, a ragged one, and a non-contiguous view."""
    wide = random_tensor(torch.float32, (64, 96 * 1024), seed=3)  # 24 MiB
    return {
        "a": random_tensor(torch.float32, (5 * 1024, 1024), seed=2),  # 20 MiB
        "b": wide[:, ::2],  # non-contiguous: staged by torch's own copy
        "c": random_tensor(torch.bfloat16, (3 * MiB + 5,), seed=4),
    }


def assert_holds(path: Path, expected: dict[str, torch.Tensor]) -> None:
    ss.verify(path)  # digests computed on the hashing threads match the bytes on disk
    target = blank_like(expected)
    ss.load(target, path)
    for k, v in expected.items():
        assert_bitwise_equal(target[k], v)


def test_async_save_with_parallel_copies_holds_call_time_values(tmp_path: Path) -> None:
    state = large_state()
    expected = {k: v.clone() for k, v in state.items()}
    handle = ss.async_save(state, tmp_path / "ckpt", pool=ss.HostBufferPool())
    for t in state.values():
        t.fill_(0)  # the training step right after the call
    handle.wait()
    assert_holds(tmp_path / "ckpt", expected)


def test_pool_smaller_than_state_hands_held_pieces_over_instead_of_waiting(tmp_path: Path) -> None:
    """Held writes must be released when staging needs the buffers back (no deadlock)."""
    state = large_state()
    expected = {k: v.clone() for k, v in state.items()}
    pool = ss.HostBufferPool(budget_bytes=8 * MiB, slab_bytes=2 * MiB)
    options = ss.SaveOptions(timeout=60, piece_bytes=2 * MiB, block_bytes=MiB)
    handle = ss.async_save(state, tmp_path / "ckpt", pool=pool, options=options)
    for t in state.values():
        t.fill_(0)
    handle.wait(timeout=120)
    assert pool.peak_bytes <= 8 * MiB
    assert_holds(tmp_path / "ckpt", expected)


def test_blocking_save_with_many_pieces_per_chunk(tmp_path: Path) -> None:
    """Writing and hashing run on different threads; each chunk still hashes in order."""
    state = large_state()
    ss.save(state, tmp_path / "ckpt", options=ss.SaveOptions(piece_bytes=3 * MiB, block_bytes=MiB))
    assert_holds(tmp_path / "ckpt", state)


def test_a_failed_staging_gives_held_buffers_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held pieces, and the one whose copy failed, go back to the pool when staging fails."""
    pool = ss.HostBufferPool(budget_bytes=8 * MiB, slab_bytes=2 * MiB)
    options = ss.SaveOptions(timeout=10, piece_bytes=2 * MiB)
    state = {"a": random_tensor(torch.float32, (3, 512 * 1024), seed=5)}  # three 2 MiB pieces
    real_copy, calls = staging.copy_bytes, []

    def failing_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        real_copy(dst, src)

    monkeypatch.setattr(staging, "copy_bytes", failing_copy)
    with pytest.raises(MemoryError):
        ss.async_save(state, tmp_path / "bad", pool=pool, options=options)
    pool.seal()
    pool.clear()  # drops every idle slab: a slab still counted as in use was leaked
    assert pool.allocated_bytes == 0
    monkeypatch.setattr(staging, "copy_bytes", real_copy)
    ss.async_save(state, tmp_path / "good", pool=pool, options=options).wait()
    assert_holds(tmp_path / "good", state)


def flip_byte_of(path: Path, key: str) -> None:
    chunk = ss.inspect(path).tensors[key].chunks[0]
    with open(path / chunk.file, "r+b") as f:
        f.seek((chunk.start + chunk.end) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_flipped_byte_in_a_middle_chunk_is_caught_by_the_background_checks(
    tmp_path: Path,
) -> None:
    state = {f"t{i}": random_tensor(torch.float32, (256, 1024), seed=i) for i in range(6)}
    ss.save(state, tmp_path / "ckpt")
    flip_byte_of(tmp_path / "ckpt", "t3")
    with pytest.raises(ss.CorruptCheckpointError, match="t3"):
        ss.load(blank_like(state), tmp_path / "ckpt")


def test_a_backend_subclass_that_changes_read_into_sees_every_read(tmp_path: Path) -> None:
    from snapstate.storage.local import LocalStorage

    class Counting(LocalStorage):
        seen = 0

        def read_into(self, path: str, offset: int, out: memoryview) -> None:
            Counting.seen += len(out)
            super().read_into(path, offset, out)

    state = large_state()
    ss.save(state, tmp_path / "ckpt")
    target = blank_like(state)
    result = ss.load(target, Counting(str(tmp_path / "ckpt")))
    assert (
        Counting.seen
        >= result.bytes_read
        == sum(v.numel() * v.element_size() for v in state.values())
    )
    for k, v in state.items():
        assert_bitwise_equal(target[k], v)


def test_a_blocking_save_writes_small_chunks_from_where_they_lie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No staging copy: copy_run fails if called."""

    def no_copy(*_: object) -> None:
        raise AssertionError("a blocking save copied a run")

    monkeypatch.setattr(staging, "copy_run", no_copy)
    state = {
        "f": random_tensor(torch.float32, (3, 5), seed=1),
        "h": random_tensor(torch.float16, (7,), seed=2),  # odd bytes: a gap follows
        "i": random_tensor(torch.int64, (9,), seed=3),
        "b": random_tensor(torch.int8, (5,), seed=4),
    }
    ss.save(state, tmp_path / "ckpt")
    assert_holds(tmp_path / "ckpt", state)


def test_gathered_bytes_fill_the_gaps_with_zeros() -> None:
    from snapstate.state.views import gathered

    views = [memoryview(b"abc"), memoryview(b""), memoryview(b"de")]
    staged = gathered(views, (0, 4, 4), 8)
    assert b"".join(bytes(b) for b in staged.buffers) == b"abc\0de\0\0"
    assert [bytes(staged.part(i, 0, 0)) for i in range(3)] == [b"abc", b"", b"de"]


def test_vectored_writes_past_the_iov_limit_and_after_a_short_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from snapstate.storage import local

    buffers = tuple(
        memoryview(bytes([i % 251]) * (1 + i % 7)) for i in range(2 * local.IOV_MAX + 5)
    )
    real, calls = local.os.pwritev, []

    def short_once(fd: int, group: list[memoryview], offset: int) -> int:
        calls.append(len(group))
        if len(calls) == 2:  # the second call writes only part of its first buffer
            return real(fd, [group[0][:1]], offset)
        return real(fd, group, offset)

    monkeypatch.setattr(local.os, "pwritev", short_once)
    writer = local.LocalFileWriter(str(tmp_path / "f"))
    writer.write_at(memoryview(b"head"), 0)
    assert writer.write_many(buffers, 4) == sum(map(len, buffers))
    writer.close()
    assert max(calls) <= local.IOV_MAX and len(calls) == 3
    assert (tmp_path / "f").read_bytes() == b"head" + b"".join(bytes(b) for b in buffers)


def test_reads_close_together_are_batched_and_far_ones_are_not() -> None:
    from snapstate.engine.readorder import BATCH_GAP_BYTES, DirectRead, batches

    def read(offset: int, n: int) -> DirectRead:
        return DirectRead("f", offset, memoryview(bytearray(n)), f"k{offset}", lambda: None)

    reads = [read(0, 10), read(16, 0), read(16, 8), read(24 + BATCH_GAP_BYTES + 1, 4)]
    assert [[r.offset for r in b] for b in batches(reads)] == [[0, 16, 16], [reads[3].offset]]


def test_a_short_vectored_read_is_finished_and_a_cut_off_file_names_its_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from snapstate.storage import local

    state = {f"t{i}": random_tensor(torch.float32, (100 + i,), seed=i) for i in range(40)}
    ss.save(state, tmp_path / "ckpt")
    real = local.os.preadv

    def short(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        return real(fd, buffers[:3], offset, *flags)  # fewer bytes than asked

    monkeypatch.setattr(local.os, "preadv", short)
    assert_holds(tmp_path / "ckpt", state)
    monkeypatch.undo()
    last = max(
        (c for t in ss.inspect(tmp_path / "ckpt").tensors.values() for c in t.chunks),
        key=lambda c: c.start,
    )
    shard = tmp_path / "ckpt" / last.file
    shard.write_bytes(shard.read_bytes()[: last.start + 3])
    with pytest.raises(ss.CorruptCheckpointError, match="manifest says"):
        ss.load(blank_like(state), tmp_path / "ckpt")  # the size check before any read
    from snapstate.engine import verify

    # a file cut between that check and the reads: the batch's error names the chunk
    monkeypatch.setattr(verify, "check_shard_file", lambda *_: None)
    with pytest.raises(ss.CorruptCheckpointError, match="truncated") as info:
        ss.load(blank_like(state), tmp_path / "ckpt")
    assert info.value.key == last.name.split("@")[0]


def test_a_batch_cut_short_once_is_read_again_chunk_by_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vectored read that meets the end of a file which then grows back (a race on a
    changing checkpoint): the reads one by one succeed, and the load holds every byte."""
    from snapstate.engine import load
    from snapstate.storage import local

    state = {f"t{i}": random_tensor(torch.float32, (100 + i,), seed=i) for i in range(40)}
    ss.save(state, tmp_path / "ckpt")
    real, cut = local.LocalFileReader.read_many, []

    def at_end_once(self: local.LocalFileReader, offset: int, buffers: list[memoryview]) -> None:
        if not cut:
            cut.append(offset)
            raise EOFError(f"{self.full_path}: file ends at byte {offset}")
        real(self, offset, buffers)

    monkeypatch.setattr(local.LocalFileReader, "read_many", at_end_once)
    monkeypatch.setattr(load, "can_map", lambda *_: False)  # the read-in-place path batches
    assert_holds(tmp_path / "ckpt", state)
    assert cut, "the load took the vectored read"


def test_ranks_on_one_host_share_its_cores_for_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = staging.copy_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 2))  # more ranks than cores here
    assert staging.copy_threads() == 1 <= alone == min(8, cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert staging.copy_threads() == alone


def test_buffers_are_not_filled_under_deterministic_algorithms(tmp_path: Path) -> None:
    """Staging slabs and read scratch skip torch's fill of new memory (uint8: 255) under
    ``torch.use_deterministic_algorithms``, a pass over bytes overwritten at once; a save
    and a load under it are still bitwise."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert bool((torch.empty(4 * MiB, dtype=torch.uint8) == 255).all())  # torch fills
        fresh = empty_bytes(4 * MiB)
        assert not bool((fresh == 255).all()) and fresh.data_ptr() % 64 == 0
        slab = staging.Slab(4 * MiB, pinned=False)
        assert not bool((slab.buffer == 255).all())
        assert slab.buffer.data_ptr() % staging.PAGE_ALIGN == 0
        state = {"w": random_tensor(torch.float32, (512, 256), seed=3)}
        ss.async_save(state, str(tmp_path / "ckpt"), pool=ss.HostBufferPool()).wait()
        restored = blank_like(state)
        ss.load(restored, str(tmp_path / "ckpt"))
        assert_bitwise_equal(restored["w"], state["w"])
    finally:
        torch.use_deterministic_algorithms(was)

"""Direct writes: an async save's staged bytes reach the disk past the page cache.

The writer sends the aligned middle of a write with O_DIRECT when the buffer and the file
offset agree modulo a page, and everything else through the cache; a file system that
refuses O_DIRECT (tmpfs) gets every byte through the cache. Every case checks the bytes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import snapstate as ss
from snapstate.engine.staging import HostBufferPool
from snapstate.storage import local
from snapstate.storage.local import (
    DIRECT_ALIGN,
    LocalFileWriter,
    LocalStorage,
    buffer_address,
    direct_span,
)

MIB = 1 << 20


def _direct_supported(path: Path) -> bool:
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return False
    probe = path / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | flag))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def _direct_skips_cache(path: Path) -> bool:
    """Whether this file system keeps O_DIRECT writes out of the page cache (ext4 and xfs
    do; some accept the flag and cache anyway), asked with a write of its own."""
    if not _direct_supported(path):
        return False
    probe = path / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        os.pwrite(fd, _aligned(DIRECT_ALIGN, 0), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        return not LocalStorage(str(path)).cached("probe", [0])
    finally:
        probe.unlink()


def _aligned(nbytes: int, skew: int) -> memoryview:
    """Random bytes whose first byte lies ``skew`` bytes past a page boundary."""
    raw = np.empty(nbytes + 2 * DIRECT_ALIGN, np.uint8)
    start = -raw.__array_interface__["data"][0] % DIRECT_ALIGN + skew
    out = raw[start : start + nbytes]
    out[:] = np.random.default_rng(nbytes + skew).integers(0, 256, nbytes, dtype=np.uint8)
    return memoryview(out)


def _write(
    tmp_path: Path, data: memoryview, offset: int, direct: bool = True, probe: int = 0
) -> tuple[bytes, int, bool]:
    """The file's bytes, the bytes written direct, and whether byte ``probe`` was cached
    after the write (asked before the file is read back)."""
    storage = LocalStorage(str(tmp_path), direct_io=direct)
    writer = storage.open_writer("f.bin", 0)
    writer.write_at(memoryview(b"h" * offset), 0)
    writer.write_at(data, offset)
    writer.close()
    cached = storage.cached("f.bin", [probe])
    return (tmp_path / "f.bin").read_bytes(), writer.direct_bytes, cached


def test_direct_span_is_the_aligned_middle() -> None:
    assert direct_span(4096 * 10 + 100, 100, 3 * MIB) == (3996, 3996 + 3 * MIB - 4096)
    assert direct_span(4096 * 10 + 100, 101, 3 * MIB) is None  # address and offset disagree
    assert direct_span(0, 0, MIB - 1) is None  # too small to be worth it
    assert direct_span(0, 0, 2 * MIB) == (0, 2 * MIB)


@pytest.mark.parametrize("skew", [0, 1000])
def test_a_write_that_agrees_with_its_offset_goes_direct(tmp_path: Path, skew: int) -> None:
    data = _aligned(3 * MIB + 123, skew)
    content, direct, cached = _write(
        tmp_path, data, offset=DIRECT_ALIGN + skew, probe=2 * DIRECT_ALIGN + MIB
    )
    assert content == b"h" * (DIRECT_ALIGN + skew) + bytes(data)
    if _direct_supported(tmp_path):
        assert direct == (3 * MIB + 123 - (-skew % DIRECT_ALIGN)) // DIRECT_ALIGN * DIRECT_ALIGN
    if _direct_skips_cache(tmp_path):
        assert not cached  # the pages written direct are not in the page cache


def test_a_write_that_disagrees_goes_through_the_cache(tmp_path: Path) -> None:
    data = _aligned(2 * MIB, 64)
    content, direct, _ = _write(tmp_path, data, offset=100)
    assert content == b"h" * 100 + bytes(data) and direct == 0


def test_direct_io_off_keeps_every_byte_in_the_cache(tmp_path: Path) -> None:
    data = _aligned(2 * MIB, 0)
    content, direct, cached = _write(tmp_path, data, DIRECT_ALIGN, direct=False, probe=MIB)
    assert content == b"h" * DIRECT_ALIGN + bytes(data) and direct == 0 and cached


def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refuse_direct(path: str, flags: int, *a: int) -> int:
        if flags & (local._O_DIRECT or 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refuse_direct)
    data = _aligned(2 * MIB, 0)
    content, direct, _ = _write(tmp_path, data, offset=DIRECT_ALIGN)
    assert content == b"h" * DIRECT_ALIGN + bytes(data) and direct == 0


def _fail_direct_writes(
    monkeypatch: pytest.MonkeyPatch, writer: LocalFileWriter, code: int
) -> None:
    """Writes through the writer's O_DIRECT descriptor fail with ``code``."""
    real_pwrite = os.pwrite

    def failing(fd: int, data: memoryview, offset: int) -> int:
        if fd == writer._direct_fd:
            raise OSError(code, os.strerror(code))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing)


def test_a_direct_write_refused_midway_finishes_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = LocalStorage(str(tmp_path)).open_writer("f.bin", 0)
    _fail_direct_writes(monkeypatch, writer, errno.EINVAL)
    data = _aligned(2 * MIB, 0)
    writer.write_at(data, 0)
    writer.write_at(data, 2 * MIB)  # after the refusal: straight through the cache
    writer.close()
    assert (tmp_path / "f.bin").read_bytes() == bytes(data) * 2 and writer.direct_bytes == 0


def test_other_direct_write_errors_are_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    writer = LocalStorage(str(tmp_path)).open_writer("f.bin", 0)
    _fail_direct_writes(monkeypatch, writer, errno.ENOSPC)
    with pytest.raises(OSError) as err:
        writer.write_at(_aligned(2 * MIB, 0), 0)
    assert err.value.errno == errno.ENOSPC
    writer.abort()
    assert not (tmp_path / "f.bin").exists()


@pytest.mark.parametrize("file_offset", [0, 57, 4095, 12345])
def test_staging_places_bytes_where_their_file_offset_agrees(file_offset: int) -> None:
    pool = HostBufferPool(budget_bytes=8 * MIB, slab_bytes=MIB)
    for nbytes in (1000, 300_000, MIB):  # the last one a whole slab: a new one, still placed
        slab, at = pool.reserve(nbytes, None, file_offset=file_offset)
        address = buffer_address(slab.bytes[at : at + nbytes])
        assert (address - file_offset) % DIRECT_ALIGN == 0
        assert at + nbytes <= slab.room
        pool.release(slab)


def test_an_async_save_writes_its_large_chunks_past_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end, the staged chunk's aligned middle goes through the O_DIRECT descriptor.

    Counted at the writer rather than asked of the page cache afterwards: whether a page
    written direct stays out of the cache is the kernel's business (checked above, on a
    write of our own) and a busy machine's readahead or reclaim makes that answer racy.
    """
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    direct: dict[str, int] = {}
    real_close = LocalFileWriter.close

    def counting_close(self: LocalFileWriter, sync: bool = True) -> None:
        direct[os.path.basename(self.full_path)] = self.direct_bytes
        real_close(self, sync)

    monkeypatch.setattr(LocalFileWriter, "close", counting_close)
    state = {"w": torch.randn(1024, 1024), "b": torch.arange(10)}
    ss.async_save(state, str(tmp_path / "ckpt"), pool=ss.HostBufferPool()).wait()
    chunk = ss.inspect(str(tmp_path / "ckpt")).tensors["w"].chunks[0]
    first_page = -(-chunk.start // DIRECT_ALIGN)  # the first whole page of the chunk
    aligned_middle = (chunk.end // DIRECT_ALIGN - first_page) * DIRECT_ALIGN
    assert direct[os.path.basename(chunk.file)] >= aligned_middle
    restored = {"w": torch.zeros(1024, 1024), "b": torch.zeros(10, dtype=torch.int64)}
    ss.load(restored, str(tmp_path / "ckpt"))
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])

"""async_save: returns after staging, holds call-time values, surfaces background errors."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import snapstate as ss
from snapstate.engine import staging
from snapstate.format.dtypes import DTYPES
from snapstate.storage.local import LocalFileWriter
from support.bits import assert_bitwise_equal, assert_tree_equal
from support.procs import wait_for
from support.states import blank_like
from support.tensors import random_tensor, zeros_like_layout

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_save_left_in_flight() -> Iterator[None]:
    yield
    try:
        ss.api.wait_for_pending()
    except Exception:  # noqa: BLE001 - a test that left an error behind already checked it
        pass


class Gate:
    """Holds background writes (not the header written while staging) until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.blocked = threading.Event()
        original = LocalFileWriter.write_at

        def write_at(writer: LocalFileWriter, data: memoryview, offset: int) -> None:
            if threading.current_thread() is not threading.main_thread():
                self.blocked.set()
                assert self.opened.wait(30), "gate never opened"
            original(writer, data, offset)

        monkeypatch.setattr(LocalFileWriter, "write_at", write_at)

    def open(self) -> None:
        self.opened.set()


def make_state() -> dict:
    base = torch.randn(64, 64)
    return {
        "w": torch.randn(256, 128),
        "t": base.t(),
        "strided": base[::3, 1::2],
        "i": torch.arange(1000, dtype=torch.int64),
        "arr": np.random.default_rng(0).standard_normal((20, 30)),
        "grad": torch.randn(10, requires_grad=True),
    }


def snapshot(state: dict) -> dict:
    return {
        k: (v.detach().clone() if isinstance(v, torch.Tensor) else v.copy())
        for k, v in state.items()
    }


def mutate(state: dict) -> None:
    with torch.no_grad():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.add_(1) if v.dtype != torch.bool else v.logical_not_()
            else:
                v += 1


def load_fresh(path: Path, like: dict) -> dict:
    fresh = blank_like(like)
    ss.load(fresh, path)
    return fresh


def test_checkpoint_holds_values_of_the_moment_of_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    state = make_state()
    expected = snapshot(state)
    handle = ss.async_save(state, tmp_path / "c")
    mutate(state)  # right after the call: staging is over
    assert gate.blocked.wait(10) and not handle.done()
    mutate(state)  # while the background write runs
    assert not (tmp_path / "c" / "manifest.json").exists()
    gate.open()
    result = handle.wait()
    assert handle.done() and result.blocking_s <= result.total_s
    assert_tree_equal(load_fresh(tmp_path / "c", expected), expected)


def test_blocking_save_after_async_save_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    first = ss.async_save({"x": torch.ones(1000)}, tmp_path / "a")
    assert gate.blocked.wait(10)
    finished = threading.Event()

    def second() -> None:
        ss.async_save({"y": torch.zeros(1000)}, tmp_path / "b").wait()
        finished.set()

    worker = threading.Thread(target=second)
    worker.start()
    time.sleep(0.3)
    assert not finished.is_set() and not first.done(), (
        "a second save started while one was in flight"
    )
    gate.open()
    worker.join(30)
    assert finished.is_set() and first.done()
    assert ss.inspect(tmp_path / "a").tensors and ss.inspect(tmp_path / "b").tensors


def fail_with_enospc(monkeypatch: pytest.MonkeyPatch) -> None:
    def write_at(self: LocalFileWriter, data: memoryview, offset: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.pwrite(self.fd, data, offset)

    monkeypatch.setattr(LocalFileWriter, "write_at", write_at)


def test_background_error_surfaces_on_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ss.save({"x": torch.ones(100)}, tmp_path / "c")
    fail_with_enospc(monkeypatch)
    handle = ss.async_save({"x": torch.full((100,), 2.0)}, tmp_path / "new")
    with pytest.raises(OSError) as info:
        handle.wait()
    assert info.value.errno == errno.ENOSPC and handle.done()
    assert not (tmp_path / "new" / "manifest.json").exists()
    assert not list((tmp_path / "new" / "shards").iterdir()), "temporary shard files left behind"
    monkeypatch.undo()
    target = {"x": torch.zeros(100)}
    ss.load(target, tmp_path / "c")  # the previous checkpoint is intact
    assert torch.equal(target["x"], torch.ones(100))


def leave_an_unobserved_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An async save fails in the background and nobody waits on its handle."""
    fail_with_enospc(monkeypatch)
    handle = ss.async_save({"x": torch.ones(100)}, tmp_path / "a")
    wait_for(handle.done, 30, "the failing background save")
    monkeypatch.undo()


def test_unobserved_background_error_surfaces_on_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leave_an_unobserved_error(tmp_path, monkeypatch)
    with pytest.raises(OSError) as info:
        ss.save({"x": torch.ones(100)}, tmp_path / "b")
    assert info.value.errno == errno.ENOSPC
    ss.save({"x": torch.ones(100)}, tmp_path / "b")  # reported once; the next save works
    assert ss.verify(tmp_path / "b").ok


def test_unobserved_error_also_surfaces_on_the_next_async_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leave_an_unobserved_error(tmp_path, monkeypatch)
    with pytest.raises(OSError):
        ss.async_save({"x": torch.ones(100)}, tmp_path / "b")
    ss.async_save({"x": torch.ones(100)}, tmp_path / "b").wait()


def test_error_seen_on_wait_is_not_raised_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_with_enospc(monkeypatch)
    handle = ss.async_save({"x": torch.ones(100)}, tmp_path / "a")
    with pytest.raises(OSError):
        handle.wait()
    monkeypatch.undo()
    ss.save({"x": torch.ones(100)}, tmp_path / "b")


class CountingSlab(staging.Slab):
    created = 0

    def __init__(self, nbytes: int, pinned: bool) -> None:
        CountingSlab.created += 1
        super().__init__(nbytes, pinned)


def test_small_pool_streams_a_large_state_within_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging, "Slab", CountingSlab)
    CountingSlab.created = 0
    pool = ss.HostBufferPool(budget_bytes=8 * MiB, slab_bytes=1 * MiB)
    gen = torch.Generator().manual_seed(0)
    # 64 MiB; half of it transposed views, which stream through the slabs row by row
    state = {f"m{i}": torch.randn(1024, 1024, generator=gen) for i in range(16)}
    state.update({k: v.t() for k, v in list(state.items())[::2]})
    expected = snapshot(state)

    # The writer waits until staging has filled the whole budget: the pool grows to full size.
    original = LocalFileWriter.write_at

    def slow_start(writer: LocalFileWriter, data: memoryview, offset: int) -> None:
        deadline = time.monotonic() + 20
        background = threading.current_thread() is not threading.main_thread()
        while background and pool.allocated_bytes < 8 * MiB and time.monotonic() < deadline:
            time.sleep(0.005)
        original(writer, data, offset)

    monkeypatch.setattr(LocalFileWriter, "write_at", slow_start)
    ss.async_save(state, tmp_path / "a", pool=pool).wait()
    monkeypatch.setattr(LocalFileWriter, "write_at", original)
    assert pool.peak_bytes == pool.allocated_bytes == 8 * MiB
    assert CountingSlab.created == 8

    mutate(state)
    ss.async_save(state, tmp_path / "b", pool=pool).wait()
    assert CountingSlab.created == 8, "the second save allocated new slabs"
    assert pool.peak_bytes == pool.allocated_bytes == 8 * MiB

    assert_tree_equal(load_fresh(tmp_path / "a", expected), expected)
    assert_tree_equal(load_fresh(tmp_path / "b", expected), snapshot(state))


def test_default_pool_is_reused_between_async_saves(tmp_path: Path) -> None:
    state = {"x": torch.randn(1000)}
    ss.async_save(state, tmp_path / "a").wait()
    pool = ss.api.default_pool()
    allocated = pool.allocated_bytes
    ss.async_save(state, tmp_path / "b").wait()
    assert ss.api.default_pool() is pool and pool.allocated_bytes == allocated


def test_wait_and_done_on_a_finished_handle(tmp_path: Path) -> None:
    handle = ss.async_save({"x": torch.ones(10)}, tmp_path / "c", step=5)
    result = handle.wait()
    assert handle.done() and handle.wait() is result and result.step == 5
    assert ss.verify(tmp_path / "c").ok


def test_process_exiting_right_after_async_save_still_commits(tmp_path: Path) -> None:
    code = (
        "import torch, snapstate as ss\n"
        f"ss.async_save({{'x': torch.arange(100000)}}, {str(tmp_path / 'c')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    target = {"x": torch.zeros(100000, dtype=torch.int64)}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["x"], torch.arange(100000))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_dtype_and_layout_through_the_pool(tmp_path: Path) -> None:
    state = {}
    for i, (name, dtype) in enumerate(sorted(DTYPES.items())):
        base = random_tensor(dtype, (6, 8), seed=i)
        state.update(
            {name: base, f"{name}.t": base.t(), f"{name}.s": base[0, 3], f"{name}.e": base[:0]}
        )
    state["expanded"] = torch.tensor([1.5]).expand(5, 3)
    pool = ss.HostBufferPool(budget_bytes=1 << 20, slab_bytes=4096)
    expected = {k: v.clone() if k == "expanded" else v for k, v in state.items()}
    ss.async_save(state, tmp_path / "c", pool=pool).wait()
    fresh = {
        k: zeros_like_layout(v) if k != "expanded" else torch.zeros(5, 3) for k, v in state.items()
    }
    ss.load(fresh, tmp_path / "c")
    for key, value in expected.items():
        assert_bitwise_equal(fresh[key], value.contiguous() if key == "expanded" else value)


def test_empty_and_tensorless_states(tmp_path: Path) -> None:
    ss.async_save({}, tmp_path / "a").wait()
    ss.async_save({"epoch": 1, "cfg": {"name": None}}, tmp_path / "b").wait()
    assert ss.verify(tmp_path / "a").ok and ss.verify(tmp_path / "b").ok
    target = {"epoch": 0, "cfg": {"name": "x"}}
    ss.load(target, tmp_path / "b")
    assert target == {"epoch": 1, "cfg": {"name": None}}


def test_rows_larger_than_the_budget_are_streamed_too(tmp_path: Path) -> None:
    pool = ss.HostBufferPool(budget_bytes=2 * MiB, slab_bytes=256 << 10)
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 1 << 20, generator=gen)  # 8 MiB in two rows of 4 MiB
    state = {
        "wide": wide,
        "wide_t": torch.randn(1 << 20, 2, generator=gen).t(),
        "cube": torch.randn(1, 3, 1 << 19),
    }
    expected = snapshot(state)
    ss.async_save(state, tmp_path / "c", pool=pool).wait()
    assert pool.peak_bytes <= 2 * MiB
    assert_tree_equal(load_fresh(tmp_path / "c", expected), expected)

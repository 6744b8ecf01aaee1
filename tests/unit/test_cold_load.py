"""Loads from shards whose pages are not cached: mapped while the state fits the page cache;
beyond that read in place, old values copied aside ahead.

The files are made cold for real: POSIX_FADV_DONTNEED drops a file's clean pages from the
page cache (no root needed), and the load probes them with RWF_NOWAIT reads.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from snapstate.engine import load as load_mod
from snapstate.engine.rollback import Rollback
from snapstate.state.restore import ReadRequest
from snapstate.storage.local import LocalStorage
from support.bits import assert_bitwise_equal
from support.pagecache import drop_cached_pages
from support.states import blank_like
from support.tensors import random_tensor

pytestmark = pytest.mark.skipif(
    not hasattr(os, "RWF_NOWAIT"), reason="needs RWF_NOWAIT reads (Linux)"
)


def state() -> dict[str, torch.Tensor]:
    out = {f"t{i}": random_tensor(torch.float32, (256, 33 + i), seed=i) for i in range(12)}
    out["big"] = random_tensor(torch.float32, (1 << 19,), seed=99)  # 2 MiB
    out["empty"] = torch.zeros(0)
    return out


def shard_of(ckpt: Path, key: str) -> tuple[str, int, int]:
    chunk = ss.inspect(ckpt).tensors[key].chunks[0]
    return chunk.file, chunk.start, chunk.end


def transports(monkeypatch: pytest.MonkeyPatch, mappable: bool = False) -> list[str]:
    """Records, per load, which way it went: 'mapped', 'ahead' or 'in place' (unless
    ``mappable``, these small states are refused the mapping, as one beyond a quarter of
    the machine's memory is)."""
    if not mappable:
        monkeypatch.setattr(load_mod, "can_map", lambda *_: False)
    seen: list[str] = []
    real_mapped = load_mod.load_mapped
    real_rollback = load_mod.Rollback

    def mapped(*args: Any, **kwargs: Any) -> int:
        seen.append("mapped")
        return real_mapped(*args, **kwargs)

    def rollback(reads: list[ReadRequest], *, ahead: bool = False) -> Rollback:
        if ahead:
            seen.append("ahead")
        elif reads:
            seen.append("in place")
        return real_rollback(reads, ahead=ahead)

    monkeypatch.setattr(load_mod, "load_mapped", mapped)
    monkeypatch.setattr(load_mod, "Rollback", rollback)
    return seen


def test_a_cold_state_that_fits_the_page_cache_keeps_the_mapped_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = transports(monkeypatch, mappable=True)
    s = state()
    ss.save(s, tmp_path / "ckpt")
    drop_cached_pages(tmp_path / "ckpt")
    target = blank_like(s)
    ss.load(target, tmp_path / "ckpt")
    assert seen == ["mapped"]
    for k, v in s.items():
        assert_bitwise_equal(target[k], v)


def test_the_probe_tells_cold_pages_from_cached_ones(tmp_path: Path) -> None:
    ss.save(state(), tmp_path / "ckpt")
    file, start, end = shard_of(tmp_path / "ckpt", "big")
    storage = LocalStorage(str(tmp_path / "ckpt"))
    drop_cached_pages(tmp_path / "ckpt")
    assert not storage.cached(file, [start, end - 1])
    with open(tmp_path / "ckpt" / file, "rb") as f:
        f.read()
    assert storage.cached(file, [start, end - 1])


def test_a_cold_load_reads_in_place_and_restores_every_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = transports(monkeypatch)
    s = state()
    ss.save(s, tmp_path / "ckpt", options=ss.SaveOptions(block_bytes=64 << 10))
    drop_cached_pages(tmp_path / "ckpt")
    target = blank_like(s)
    ss.load(target, tmp_path / "ckpt")
    for k, v in s.items():
        assert_bitwise_equal(target[k], v)
    ss.load(target, tmp_path / "ckpt")  # now cached: every copy kept before the reads
    assert seen == ["ahead", "in place"]


@pytest.mark.parametrize("victim", ["t0", "big"])
def test_a_corrupt_cold_shard_leaves_every_target_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: str
) -> None:
    seen = transports(monkeypatch)
    s = state()
    ckpt = tmp_path / "ckpt"
    ss.save(s, ckpt, options=ss.SaveOptions(block_bytes=64 << 10))
    file, _, end = shard_of(ckpt, victim)
    with open(ckpt / file, "r+b") as f:
        f.seek(end - 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    drop_cached_pages(ckpt)
    target = {k: torch.full_like(v, 7) for k, v in blank_like(s).items()}
    before = {k: v.clone() for k, v in target.items()}
    with pytest.raises(ss.CorruptCheckpointError) as info:
        ss.load(target, ckpt)
    assert info.value.key == victim
    assert seen == ["ahead"]
    for k, v in before.items():
        assert_bitwise_equal(target[k], v)


def test_tied_targets_get_their_first_values_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tensor under two keys, read in place from a cold cache, comes back as it was."""
    seen = transports(monkeypatch)
    shared = random_tensor(torch.float32, (1 << 18,), seed=5)
    ckpt = tmp_path / "ckpt"
    ss.save(
        {"a": shared, "b": shared.clone(), "c": random_tensor(torch.float32, (99,), seed=6)}, ckpt
    )
    chunk = ss.inspect(ckpt).tensors["c"].chunks[0]
    with open(ckpt / chunk.file, "r+b") as f:  # c fails after a and b were read
        f.seek(chunk.end - 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    drop_cached_pages(ckpt)
    tied = torch.full((1 << 18,), 3.0)
    target = {"a": tied, "b": tied, "c": torch.zeros(99)}
    with pytest.raises(ss.CorruptCheckpointError):
        ss.load(target, ckpt)
    assert seen == ["ahead"]
    assert torch.equal(tied, torch.full((1 << 18,), 3.0))


def hold_copy_of(key: str, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Rollback's copy aside of ``key`` waits until the returned event is set."""
    gate = threading.Event()
    real_save = Rollback._save

    def held(req: ReadRequest) -> Any:
        if req.key == key:
            gate.wait(10)
        return real_save(req)

    monkeypatch.setattr(Rollback, "_save", staticmethod(held))
    return gate


def test_a_read_waits_until_its_target_is_copied_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies run on their own thread; ``saved(i)`` returns only once request i is kept."""
    gate = hold_copy_of("k1", monkeypatch)
    targets = [torch.full((4,), float(i)) for i in range(3)]
    rollback = Rollback([ReadRequest(f"k{i}", t, False) for i, t in enumerate(targets)], ahead=True)
    rollback.saved(0)
    waited = threading.Event()
    threading.Thread(target=lambda: (rollback.saved(1), waited.set()), daemon=True).start()
    assert not waited.wait(0.2)  # k1 is not kept aside yet
    gate.set()
    assert waited.wait(10)
    rollback.saved(2)
    for t in targets:  # every read may write now
        t.fill_(-1)
    rollback.restore()
    for i, t in enumerate(targets):
        assert torch.equal(t, torch.full((4,), float(i)))


def test_a_failed_copy_aside_fails_the_read_that_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(req: ReadRequest) -> Any:
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(Rollback, "_save", staticmethod(broken))
    rollback = Rollback([ReadRequest("k0", torch.ones(3), False)], ahead=True)
    with pytest.raises(MemoryError, match="no room"):
        rollback.saved(0)
    rollback.restore()  # nothing was kept, nothing to put back


def test_a_copy_aside_taken_after_a_tied_target_was_written_is_not_the_one_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two requests on one tensor: the second is copied aside only after the first one's read
    wrote it. Restoring last-saved-first leaves the first copy, the true old value."""
    gate = hold_copy_of("b", monkeypatch)
    tied = torch.full((4,), 1.0)
    rollback = Rollback([ReadRequest("a", tied, False), ReadRequest("b", tied, False)], ahead=True)
    rollback.saved(0)
    tied.fill_(2.0)  # a's read
    gate.set()
    rollback.saved(1)  # b's copy holds a's loaded bytes
    rollback.restore()
    assert torch.equal(tied, torch.full((4,), 1.0))


def test_a_failed_copy_fails_a_rollback_made_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``ahead`` the copies are made before any read: one that fails stops the load."""

    def broken(req: ReadRequest) -> Any:
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(Rollback, "_save", staticmethod(broken))
    with pytest.raises(MemoryError, match="no room"):
        Rollback([ReadRequest("k0", torch.ones(3), False)])

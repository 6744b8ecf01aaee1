"""Loads from mapped local shards: every byte is verified before any target is written.

No copy of the targets is kept aside on this path, so each failure below must be caught
before the first target changes; the split, multi-threaded path of large states is forced
on small data by lowering its thresholds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.engine import load as load_mod
from snapstate.engine import mapped
from snapstate.storage.local import LocalStorage
from support.bits import assert_bitwise_equal
from support.states import blank_like
from support.tensors import random_tensor

MiB = 1 << 20


def state() -> dict[str, torch.Tensor]:
    out = {f"small{i}": random_tensor(torch.float32, (64, 9 + i), seed=i) for i in range(20)}
    out["big"] = random_tensor(torch.float32, (3 * MiB // 4 + 7,), seed=99)  # 3 MiB, ragged
    out["bf"] = random_tensor(torch.bfloat16, (1000,), seed=100)
    out["empty"] = torch.zeros(0)
    return out


@pytest.fixture(params=["serial", "split-and-threaded"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param != "serial":
        monkeypatch.setattr(mapped, "PARALLEL_BYTES", 0)
        monkeypatch.setattr(mapped, "SPLIT_BYTES", MiB)  # the big chunk in 1 MiB ranges
    return str(request.param)


def no_rollback(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records how many tensors each load keeps aside (0 on the mapped path)."""
    kept: list[int] = []
    real = load_mod.Rollback

    def counting(reads: list, *, ahead: bool = False) -> object:  # type: ignore[type-arg]
        kept.append(len(reads))
        return real(reads, ahead=ahead)

    monkeypatch.setattr(load_mod, "Rollback", counting)
    return kept


def test_a_local_load_is_mapped_and_keeps_nothing_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path_kind: str
) -> None:
    kept = no_rollback(monkeypatch)
    s = state()
    ss.save(s, tmp_path / "ckpt", options=ss.SaveOptions(block_bytes=256 << 10))
    target = blank_like(s)
    ss.load(target, tmp_path / "ckpt")
    for k, v in s.items():
        assert_bitwise_equal(target[k], v)
    assert kept == [0]


@pytest.mark.parametrize("victim", ["small0", "big"])
def test_a_corrupt_block_anywhere_fails_before_any_target_changes(
    tmp_path: Path, path_kind: str, victim: str
) -> None:
    s = state()
    ss.save(s, tmp_path / "ckpt", options=ss.SaveOptions(block_bytes=256 << 10))
    chunk = ss.inspect(tmp_path / "ckpt").tensors[victim].chunks[0]
    with open(tmp_path / "ckpt" / chunk.file, "r+b") as f:
        f.seek(chunk.end - 5)  # the last block of the chunk (the last range when split)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    target = {
        k: torch.full_like(v, 7) if v.is_floating_point() else v for k, v in blank_like(s).items()
    }
    before = {k: v.clone() for k, v in target.items()}
    with pytest.raises(ss.CorruptCheckpointError) as info:
        ss.load(target, tmp_path / "ckpt")
    assert info.value.key == victim
    for k, v in before.items():
        assert_bitwise_equal(target[k], v)  # not one target was written


def test_a_shard_missing_under_the_mapping_is_a_corrupt_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = state()
    ss.save(s, tmp_path / "ckpt")
    chunk = ss.inspect(tmp_path / "ckpt").tensors["big"].chunks[0]
    from snapstate.engine import verify

    monkeypatch.setattr(verify, "check_shard_file", lambda *_: None)  # removed after the check
    (tmp_path / "ckpt" / chunk.file).unlink()
    with pytest.raises(ss.CorruptCheckpointError, match="missing"):
        ss.load(blank_like(s), tmp_path / "ckpt")


def test_a_backend_that_reads_its_own_way_is_not_mapped(tmp_path: Path) -> None:
    class Counting(LocalStorage):
        def read_into(self, path: str, offset: int, out: memoryview) -> None:
            super().read_into(path, offset, out)

    assert mapped.can_map(LocalStorage(str(tmp_path)), MiB)
    assert not mapped.can_map(Counting(str(tmp_path)), MiB)
    assert not mapped.can_map(LocalStorage(str(tmp_path)), 1 << 60)  # beyond the page cache

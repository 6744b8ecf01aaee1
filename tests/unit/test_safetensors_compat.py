"""Every shard file is a valid safetensors file: the safetensors package reads it as is."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import snapstate as ss
from snapstate.format.dtypes import DTYPES, SAFETENSORS
from support.bits import assert_bitwise_equal, raw_bytes
from support.tensors import random_tensor

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def chunk_of(t: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def saved_state() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {
            f"dt_{name}": random_tensor(dtype, (5, 6), seed=i)
            for i, (name, dtype) in enumerate(DTYPES.items())
        }
    state["big"] = torch.randn(64, 100)  # 25 KiB: split in several chunks below
    state["strided"] = torch.randn(10, 10)[::2, 1::3]
    state["scalar"] = torch.tensor(2.5)
    state["empty"] = torch.empty(0, 3)
    return state


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("st") / "c"
    state = saved_state()
    options = ss.SaveOptions(plan=ss.PlanOptions(chunk_bytes=4096, max_file_bytes=8192))
    ss.save(state, path, options=options)
    return path, state


def test_several_files_and_chunks(checkpoint) -> None:
    path, _ = checkpoint
    manifest = ss.inspect(path)
    assert len(manifest.files) > 2 and len(manifest.tensors["big"].chunks) > 4


def test_safe_open_reads_every_chunk(checkpoint) -> None:
    path, state = checkpoint
    manifest = ss.inspect(path)
    for key, record in manifest.tensors.items():
        for chunk in record.chunks:
            with safe_open(str(path / chunk.file), framework="pt") as f:
                assert f.metadata()["format"] == "snapstate/1"
                stored = f.get_tensor(chunk.name)
            expected = chunk_of(state[key], chunk.offsets, chunk.sizes)
            if record.dtype in SAFETENSORS:
                assert_bitwise_equal(stored, expected)
            else:  # stored as raw bytes; the manifest keeps the true dtype
                assert stored.dtype == torch.uint8
                assert torch.equal(stored, raw_bytes(expected))


def test_load_file_reads_every_shard(checkpoint) -> None:
    path, state = checkpoint
    manifest = ss.inspect(path)
    names = {}
    for key, record in manifest.tensors.items():
        for chunk in record.chunks:
            names[(chunk.file, chunk.name)] = (key, record.dtype, chunk)
    seen = 0
    for file in manifest.files:
        loaded = load_file(str(path / file))
        for name, tensor in loaded.items():
            key, dtype, chunk = names[(file, name)]
            expected = chunk_of(state[key], chunk.offsets, chunk.sizes)
            if dtype in SAFETENSORS:
                assert_bitwise_equal(tensor, expected)
            else:
                assert torch.equal(tensor, raw_bytes(expected))
            seen += 1
    assert seen == len(names)


def test_rank_local_tensors_are_in_the_shards_too(tmp_path: Path) -> None:
    ss.save({"rl": ss.RankLocal({"t": torch.arange(6)})}, tmp_path / "c")
    (shard,) = (tmp_path / "c" / "shards").iterdir()
    loaded = load_file(str(shard))
    (name,) = loaded
    assert name.startswith("rank0/") and torch.equal(loaded[name], torch.arange(6))

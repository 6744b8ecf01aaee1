"""Small chunks staged in runs (one batched copy each) come back bitwise, in every mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8]


def _many_small(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for i in range(120):
        dtype = DTYPES[i % len(DTYPES)]
        bits = torch.randint(0, 255, (3 + i % 17, 5), dtype=torch.uint8, generator=gen)
        n = bits.numel() // torch.empty(0, dtype=dtype).element_size()
        flat = bits.reshape(-1)[: n * torch.empty(0, dtype=dtype).element_size()]
        out[f"t{i}"] = flat.view(dtype)  # arbitrary bit patterns (NaN payloads included)
    out["mask"] = torch.tensor([True, False, True])
    out["big"] = torch.randn(300_000, generator=gen)  # not in a run: staged in pieces
    out["transposed"] = torch.randn(7, 9, generator=gen).t()  # non-contiguous: its own path
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("mode", ["save", "async"])
@pytest.mark.parametrize("piece_bytes", [1 << 10, 64 << 20])
def test_runs_round_trip_bitwise(tmp_path: Path, mode: str, piece_bytes: int) -> None:
    opts = ss.SaveOptions(piece_bytes=piece_bytes)
    pool = ss.HostBufferPool(64 << 20, slab_bytes=4 << 20)
    for step in range(3):  # the second and third saves reuse the plan and the slab views
        state = _many_small(step)
        path = tmp_path / f"s{step}"
        if mode == "save":
            ss.save(state, path, options=opts)
        else:
            handle = ss.async_save(state, path, options=opts, pool=pool)
            for t in state.values():  # the checkpoint holds the values of the call
                if t.is_contiguous():
                    t.view(torch.uint8).fill_(0)
            handle.wait()
        target = {k: torch.zeros_like(v) for k, v in _many_small(step).items()}
        ss.load(target, path)
        assert ss.verify(path).ok
        expected = _many_small(step)
        for k in expected:
            assert torch.equal(_bits(target[k]), _bits(expected[k])), k

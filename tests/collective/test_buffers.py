"""DDP with BatchNorm: running statistics differ across ranks between steps (DDP broadcasts
rank 0's at the next forward), so the replica check leaves buffers alone and rank 0 writes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import snapstate as ss

from .launch import RankServer

pytestmark = pytest.mark.dist


def test_batchnorm_buffers_saved_from_rank0(ranks: RankServer, tmp_path: Path) -> None:
    args = {"path": str(tmp_path / "ckpt")}
    results = ranks.run("collective.scen_buffers:save", 2, args, tmp_path / "run").check()
    assert results[0]["running_mean"] != results[1]["running_mean"]  # the replicas really differ
    assert results[0]["weight"] == results[1]["weight"]  # parameters are still true replicas
    state = ss.read_state(args["path"])
    saved = state["model"]["1.running_mean"]
    assert torch.equal(saved, torch.tensor(results[0]["running_mean"], dtype=saved.dtype))
    manifest = ss.inspect(args["path"])
    assert manifest.files  # committed
    writers = {c.file for c in manifest.tensors["model/1.running_mean"].chunks}
    assert all(manifest.files[f].rank == 0 for f in writers)

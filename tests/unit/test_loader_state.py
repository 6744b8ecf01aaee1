"""Data-loader state in one process: placement by type, and a restored loader that continues
exactly as the original, its generators and torch's global generator included."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import snapstate as ss
from snapstate.data import ElasticSampler, WorkerRNG
from snapstate.state.flatten import flatten_state
from snapstate.state.loaders import WorkerRandomnessWarning


def data() -> TensorDataset:
    return TensorDataset(torch.arange(20.0).unsqueeze(1))


def loader(generator: bool) -> StatefulDataLoader:
    gen = torch.Generator().manual_seed(3) if generator else None
    return StatefulDataLoader(data(), batch_size=3, shuffle=True, generator=gen)


def test_loaders_and_stateful_samplers_are_rank_local_and_elastic_sampler_is_global() -> None:
    state = {
        "loader": loader(True),
        "sampler": StatefulDistributedSampler(data(), num_replicas=2, rank=1),
        "elastic": ElasticSampler(20, num_replicas=2, rank=1),
        "rng": ss.RNGState(),
    }
    flat = flatten_state(state)
    assert sorted(flat.rank_local_trees) == ["loader", "rng", "sampler"]
    assert "elastic" in dict(flat.tree["d"])
    assert any(k.startswith("loader/snapstate_generators/") for k in flat.rank_local_tensors)


def batches(it, n: int) -> list[list[float]]:  # type: ignore[no-untyped-def]
    return [next(it)[0].flatten().tolist() for _ in range(n)]


def epochs(ld: StatefulDataLoader, first: object, n: int) -> list[list[float]]:
    """The rest of the current epoch (``first`` is its iterator, or None for a fresh iter()),
    then ``n`` more whole epochs, each followed by a draw from torch's global generator."""
    seen = [b[0].flatten().tolist() for b in (first if first is not None else ld)]
    seen.append([float(torch.rand(()))])
    for _ in range(n):
        seen += [b[0].flatten().tolist() for b in ld]
        seen.append([float(torch.rand(()))])
    return seen


@pytest.mark.parametrize("generator", [True, False], ids=["own-generator", "no-generator"])
@pytest.mark.parametrize("taken", [2, 7], ids=["mid-epoch", "epoch-end"])
def test_restored_loader_continues_bit_for_bit(generator: bool, taken: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    original = loader(generator)
    it = iter(original)
    batches(it, taken)  # 7 batches: the whole epoch, StopIteration not yet seen
    ss.save({"loader": original, "rng": ss.RNGState()}, tmp_path / "ckpt")
    want = epochs(original, it, 2)

    torch.manual_seed(0)
    restored = loader(generator)
    torch.rand(5)  # the new process's global generator is elsewhere until RNGState is loaded
    ss.load({"loader": restored, "rng": ss.RNGState()}, tmp_path / "ckpt")
    assert epochs(restored, None, 2) == want


def test_a_second_restore_before_iterating_replaces_the_first(tmp_path: Path) -> None:
    original = loader(True)
    it = iter(original)
    batches(it, 1)
    ss.save({"loader": original}, tmp_path / "one")
    batches(it, 2)
    ss.save({"loader": original}, tmp_path / "three")
    want = batches(it, 4)
    restored = loader(True)
    ss.load({"loader": restored}, tmp_path / "one")
    ss.load({"loader": restored}, tmp_path / "three")  # e.g. a fallback after a failed load
    assert batches(iter(restored), 4) == want


def test_multi_worker_loader_warns_once_unless_its_dataset_is_wrapped(tmp_path: Path) -> None:
    ld = StatefulDataLoader(data(), batch_size=4, num_workers=1)
    with pytest.warns(WorkerRandomnessWarning, match="snapstate.data.WorkerRNG"):
        ss.save({"warned-loader": ld}, tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", WorkerRandomnessWarning)
        ss.save({"warned-loader": ld}, tmp_path / "b")  # once per key
        wrapped = StatefulDataLoader(WorkerRNG(data()), batch_size=4, num_workers=1)
        ss.save({"wrapped-loader": wrapped}, tmp_path / "c")


def test_worker_rng_is_transparent_in_the_main_process() -> None:
    wrapped = WorkerRNG(data())
    assert len(wrapped) == 20 and wrapped[3][0].item() == 3.0
    assert wrapped.tensors[0].shape == (20, 1)  # attributes of the dataset stay visible
    assert wrapped.state_dict() == {}  # RNGState covers the main process

"""The CIFAR-10 binary reader against a file written here in the official format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from snapstate.bench.datasets import (
    ImageDataset,
    read_cifar10,
    read_cifar10_batch,
    synthetic_cifar,
    synthetic_tokens,
)


def write_official(path: Path, labels: list[int], planes: np.ndarray) -> None:
    """Records of 1 label byte then 1024 red, 1024 green, 1024 blue bytes, row-major 32x32."""
    with open(path, "wb") as f:
        for label, image in zip(labels, planes, strict=True):
            f.write(bytes([label]))
            for channel in range(3):
                f.write(image[channel].astype(np.uint8).tobytes(order="C"))


def test_reads_labels_and_planes_of_official_records(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(5, 3, 32, 32), dtype=np.uint8)
    images[0, 0, 0, 1] = 200  # red, row 0, column 1: checks row-major order within a plane
    images[0, 2, 31, 0] = 7  # blue, last row, first column
    write_official(tmp_path / "data_batch_1.bin", [3, 0, 9, 1, 1], images)
    got, labels = read_cifar10_batch(tmp_path / "data_batch_1.bin")
    assert labels.tolist() == [3, 0, 9, 1, 1]
    assert got.shape == (5, 3, 32, 32) and got.dtype == np.uint8
    assert np.array_equal(got, images)
    assert got[0, 0, 0, 1] == 200 and got[0, 2, 31, 0] == 7


def test_reads_every_training_batch_present(tmp_path: Path) -> None:
    images = np.zeros((2, 3, 32, 32), dtype=np.uint8)
    write_official(tmp_path / "data_batch_1.bin", [1, 2], images)
    write_official(tmp_path / "data_batch_2.bin", [3, 4], images + 1)
    got, labels = read_cifar10(tmp_path)
    assert labels.tolist() == [1, 2, 3, 4]
    assert got[2:].min() == 1


def test_rejects_truncated_file(tmp_path: Path) -> None:
    (tmp_path / "bad.bin").write_bytes(b"\x01" * 3000)
    with pytest.raises(ValueError, match="records"):
        read_cifar10_batch(tmp_path / "bad.bin")


def test_missing_directory_names_the_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data_batch_1.bin"):
        read_cifar10(tmp_path)


def test_synthetic_data_is_fixed_by_seed() -> None:
    a, la = synthetic_cifar(16, seed=3)
    b, lb = synthetic_cifar(16, seed=3)
    assert np.array_equal(a, b) and np.array_equal(la, lb)
    assert a.shape == (16, 3, 32, 32)
    assert len(ImageDataset(a, la)) == 16
    tokens = synthetic_tokens(4, block=8, vocab=32, seed=0)
    assert tokens.shape == (4, 9) and tokens.max() < 32


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_training_reads_cifar_from_data_dir(tmp_path: Path) -> None:
    from snapstate.bench.train import TrainConfig, Trainer

    images = np.random.default_rng(0).integers(0, 256, size=(16, 3, 32, 32), dtype=np.uint8)
    write_official(tmp_path / "data_batch_1.bin", [i % 10 for i in range(16)], images)
    cfg = TrainConfig(model="resnet18:w=0.0625", batch=4, samples=16, data_dir=str(tmp_path))
    trainer = Trainer(cfg, rank=0, world=1)
    assert len(trainer.loader.dataset) == 16
    assert np.isfinite(trainer.train_step())

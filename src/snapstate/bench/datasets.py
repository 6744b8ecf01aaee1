"""Training data: the official CIFAR-10 binary format, synthetic CIFAR-shaped images and tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

RECORD_PIXELS = 3 * 32 * 32
RECORD_BYTES = 1 + RECORD_PIXELS
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILE = "test_batch.bin"


def read_cifar10_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one ``*_batch*.bin``: (uint8 images N x 3 x 32 x 32, int64 labels N)."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % RECORD_BYTES:
        raise ValueError(
            f"{path}: {raw.size} bytes is not a whole number of {RECORD_BYTES}-byte records"
        )
    records = raw.reshape(-1, RECORD_BYTES)
    labels = records[:, 0].astype(np.int64)
    if labels.max() > 9:
        raise ValueError(f"{path}: label {labels.max()} outside 0..9; not a CIFAR-10 file")
    # Each record holds the red, green and blue planes in turn, each 32x32 row-major.
    images = records[:, 1:].reshape(-1, 3, 32, 32)
    return images, labels


def read_cifar10(data_dir: str | Path, train: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Read the training batches (or the test batch) that exist in ``data_dir``."""
    names = TRAIN_FILES if train else (TEST_FILE,)
    paths = [Path(data_dir) / n for n in names if (Path(data_dir) / n).exists()]
    if not paths:
        raise FileNotFoundError(f"no CIFAR-10 binary batches ({', '.join(names)}) in {data_dir}")
    parts = [read_cifar10_batch(p) for p in paths]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def synthetic_cifar(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-shaped images whose class shifts the mean colour, so the loss can fall."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n, dtype=np.int64)
    tint = rng.integers(0, 256, size=(10, 3, 1, 1))
    noise = rng.integers(0, 256, size=(n, 3, 32, 32))
    images = ((noise + tint[labels]) // 2).astype(np.uint8)
    return images, labels


def normalized_images(
    samples: int, data_dir: str | None, seed: int, channels_last: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Float32 images normalized as the PyTorch side does (NCHW, or NHWC for Keras), labels."""
    images, labels = read_cifar10(data_dir) if data_dir else synthetic_cifar(samples, seed)
    images, labels = images[:samples], labels[:samples]
    x = (images.astype(np.float32) / 255.0 - 0.5) / 0.25
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1) if channels_last else x), labels


def shard_order(n: int, seed: int, epoch: int, batch: int, rank: int, world: int) -> np.ndarray:
    """This rank's sample indices for ``epoch``: a shuffle fixed by (seed, epoch), then a stride.

    Stateless, so a trainer's data position is just (epoch, batches taken): TensorFlow and
    Chainer trainers resume their data exactly from those two numbers.
    """
    order = np.random.default_rng((seed, epoch)).permutation(n)
    usable = (n // (batch * world)) * batch * world
    return order[:usable][rank::world]


def synthetic_tokens(n: int, block: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Token sequences from a fixed random bigram table, so there is something to learn."""
    rng = np.random.default_rng(seed)
    nxt = rng.integers(0, vocab, size=(vocab, 4))
    seq = np.empty((n, block + 1), dtype=np.int64)
    seq[:, 0] = rng.integers(0, vocab, size=n)
    choice = rng.integers(0, 4, size=(n, block))
    for t in range(block):
        seq[:, t + 1] = nxt[seq[:, t], choice[:, t]]
    return seq


class ImageDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Normalized float images with labels, held in memory."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images = torch.from_numpy(images).float().div_(255.0).sub_(0.5).div_(0.25)
        self.labels = torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


class TokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(input, next-token target) pairs from token sequences."""

    def __init__(self, seq: np.ndarray) -> None:
        self.seq = torch.from_numpy(seq)

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seq[i, :-1], self.seq[i, 1:]


def make_dataset(
    kind: str, n: int, data_dir: str | None, seed: int, block: int = 64, vocab: int = 2048
) -> Dataset:
    """The dataset for a model kind: CIFAR-10 from ``data_dir`` if given, else synthetic."""
    if kind == "text":
        return TokenDataset(synthetic_tokens(n, block, vocab, seed))
    if data_dir:
        images, labels = read_cifar10(data_dir)
        return ImageDataset(images[:n], labels[:n])
    return ImageDataset(*synthetic_cifar(n, seed))


def make_loader(dataset: Dataset, batch: int, rank: int, world: int, seed: int) -> Any:
    """A StatefulDataLoader over this rank's shard; its position is checkpointable state."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler: DistributedSampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    # Its own generator: iter() draws a base seed, and from the global RNG that draw would
    # land at a different point of a resumed run (a new iterator mid-epoch) than of the original.
    generator = torch.Generator().manual_seed(seed)
    return StatefulDataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=0,
        drop_last=True,
        generator=generator,
    )


def augment(images: torch.Tensor) -> torch.Tensor:
    """Random horizontal flip per image, drawn from torch's global RNG (so RNG is state)."""
    flip = torch.rand(images.shape[0]) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(3), images)

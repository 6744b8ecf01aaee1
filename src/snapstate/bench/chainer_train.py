"""One Chainer rank's data-parallel training: the study's CIFAR models as ChainerMN trains them.

The same models (CIFAR ResNet-18, VGG-16, width ``w``), data and per-rank shards as the PyTorch
and TensorFlow sides. Ranks run under ``mpirun``; ChainerMN's naive communicator broadcasts the
initial weights and averages gradients (``create_multi_node_optimizer``). Training runs in a
``chainer.training.Trainer`` with a ``StandardUpdater``, so Chainer's own snapshot extension and
ChainerMN's checkpointer see the objects they were written for. Imported only in the Chainer
environment (``.venv-chainer``).
"""

from __future__ import annotations

import os
from typing import Any

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np

from snapstate.bench.datasets import normalized_images, shard_order
from snapstate.bench.models import VGG16_LAYOUT, ModelSpec, parse_model
from snapstate.integrations.chainer import named_arrays

# PyTorch's BatchNorm defaults (decay is 1 - PyTorch's momentum), so all sides train one layer.
BN = {"decay": 0.9, "eps": 1e-5}
WEIGHT_DECAY = 0.01


def _width(base: int, width: float) -> int:
    return max(4, int(round(base * width)))


class ConvBN(chainer.Chain):
    def __init__(self, cin: int, cout: int, stride: int, ksize: int = 3) -> None:
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(cin, cout, ksize, stride, ksize // 2, nobias=True)
            self.bn = L.BatchNormalization(cout, **BN)

    def forward(self, x: Any) -> Any:
        return self.bn(self.conv(x))


class BasicBlock(chainer.Chain):
    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        with self.init_scope():
            self.a = ConvBN(cin, planes, stride)
            self.b = ConvBN(planes, planes, 1)
            self.shortcut = ConvBN(cin, planes, stride, 1) if stride != 1 or cin != planes else None

    def forward(self, x: Any) -> Any:
        out = self.b(F.relu(self.a(x)))
        return F.relu(out + (self.shortcut(x) if self.shortcut is not None else x))


class ResNet18(chainer.Chain):
    """CIFAR ResNet-18: 3x3 stem without max-pool, four stages of two blocks, average pool."""

    def __init__(self, width: float) -> None:
        super().__init__()
        planes = [_width(64 * 2**i, width) for i in range(4)]
        with self.init_scope():
            self.stem = ConvBN(3, planes[0], 1)
            self.blocks = chainer.ChainList()
            cin = planes[0]
            for i, p in enumerate(planes):
                for j in range(2):
                    self.blocks.add_link(BasicBlock(cin, p, 2 if i > 0 and j == 0 else 1))
                    cin = p
            self.fc = L.Linear(cin, 10)

    def forward(self, x: Any) -> Any:
        h = F.relu(self.stem(x))
        for block in self.blocks:
            h = block(h)
        return self.fc(F.mean(h, axis=(2, 3)))


class VGG16(chainer.Chain):
    """VGG-16 with batch norm for 32x32 inputs and one linear classifier."""

    def __init__(self, width: float) -> None:
        super().__init__()
        with self.init_scope():
            self.convs = chainer.ChainList()
            cin = 3
            for item in VGG16_LAYOUT:
                if item != "M":
                    self.convs.add_link(ConvBN(cin, _width(int(item), width), 1))
                    cin = _width(int(item), width)
            self.fc = L.Linear(cin, 10)

    def forward(self, x: Any) -> Any:
        convs = iter(self.convs)
        for item in VGG16_LAYOUT:
            x = F.max_pooling_2d(x, 2) if item == "M" else F.relu(next(convs)(x))
        return self.fc(x)


CHAINER_BUILDERS = {"resnet18": ResNet18, "vgg16": VGG16}


def build_chainer_model(spec: ModelSpec) -> chainer.Chain:
    if spec.family not in CHAINER_BUILDERS:
        known = ", ".join(sorted(CHAINER_BUILDERS))
        raise ValueError(f"model {spec.name!r} has no Chainer version; known: {known}")
    return CHAINER_BUILDERS[spec.family](float(spec.get("w", "1")))


class ShardIterator:
    """This rank's batches in ``shard_order``; its position is (epoch, batches taken).

    Chainer's iterator protocol (``next``, ``epoch_detail``, ``serialize``), so the snapshot
    extension and ChainerMN's checkpointer save and restore it as they would SerialIterator.
    """

    def __init__(
        self, images: np.ndarray, labels: np.ndarray, batch: int, seed: int, rank: int, world: int
    ) -> None:
        self.images, self.labels = images, labels
        self.batch, self.seed, self.rank, self.world = batch, seed, rank, world
        self.batches_per_epoch = (len(labels) // world) // batch
        if self.batches_per_epoch < 1:
            raise ValueError(f"{len(labels)} samples give no batch of {batch} per rank")
        self.epoch = 0
        self.position = 0
        self.is_new_epoch = False

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        n, b = len(self.labels), self.batch
        order = shard_order(n, self.seed, self.epoch, b, self.rank, self.world)
        idx = order[self.position * b : (self.position + 1) * b]
        self.position += 1
        self.is_new_epoch = self.position >= self.batches_per_epoch
        return self.images[idx], self.labels[idx]

    next = __next__

    @property
    def epoch_detail(self) -> float:
        return self.epoch + self.position / self.batches_per_epoch

    @property
    def previous_epoch_detail(self) -> float:
        return self.epoch + max(0, self.position - 1) / self.batches_per_epoch

    def serialize(self, serializer: Any) -> None:
        self.epoch = int(serializer("epoch", self.epoch))
        self.position = int(serializer("position", self.position))

    def finalize(self) -> None:
        pass


def flip_converter(batch: tuple[np.ndarray, np.ndarray], device: Any = None) -> tuple[Any, Any]:
    """Random horizontal flips from numpy's global generator (Chainer's CPU randomness)."""
    x, t = batch
    flip = np.random.random_sample(len(x)) < 0.5
    return np.where(flip[:, None, None, None], x[..., ::-1], x).astype(np.float32), t


def in_mpi() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


class ChainerTrainer:
    """A ChainerMN data-parallel run: model, Adam with decoupled decay, updater and trainer."""

    device = "cpu"

    def __init__(self, cfg: Any, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.comm = self._communicator()
        self.spec = parse_model(cfg.model)
        np.random.seed(cfg.seed)  # Chainer's initializers draw from numpy's global generator
        self.model = build_chainer_model(self.spec)
        # Chainer's Adam decays by eta * rate * w; AdamW (the other sides) by lr * 0.01 * w.
        adam = chainer.optimizers.Adam(alpha=cfg.lr, weight_decay_rate=cfg.lr * WEIGHT_DECAY)
        self.optimizer = self._multi_node(adam)
        self.optimizer.setup(self.model)
        self._sync_initial_weights()
        np.random.seed(cfg.seed * 1000 + rank)  # per-rank streams: flips differ by rank
        images, labels = normalized_images(cfg.samples, cfg.data_dir, cfg.seed)
        self.iterator = ShardIterator(images, labels, cfg.batch, cfg.seed, rank, world)
        self.batches_per_epoch = self.iterator.batches_per_epoch
        self._loss = 0.0
        self.updater = chainer.training.updaters.StandardUpdater(
            {"main": self.iterator},
            self.optimizer,
            converter=flip_converter,
            loss_func=self._loss_of,
        )
        self.trainer = chainer.training.Trainer(self.updater, (10**9, "iteration"), out=".")
        # The harness calls the updater itself, where Trainer.run would: mark the run started,
        # as run() does, so the trainer can be serialized (it records its elapsed time).
        self.trainer._start_at = chainer.training.trainer._get_time()

    def _communicator(self) -> Any:
        if not in_mpi():
            if self.world > 1:
                raise RuntimeError(f"{self.world} Chainer ranks need mpirun (ChainerMN)")
            return None
        import chainermn

        comm = chainermn.create_communicator("naive")
        if comm.size != self.world or comm.rank != self.rank:
            raise RuntimeError(f"MPI rank {comm.rank}/{comm.size} != {self.rank}/{self.world}")
        return comm

    def _multi_node(self, optimizer: Any) -> Any:
        if self.comm is None:
            return optimizer
        import chainermn

        return chainermn.create_multi_node_optimizer(optimizer, self.comm)

    def _sync_initial_weights(self) -> None:
        """Broadcast rank 0's weights now: ChainerMN would spend the first update on it."""
        if self.comm is None:
            return
        self.comm.bcast_data(self.model)
        self.optimizer.is_changed(self.model)  # records the parameter list: later updates step

    def _loss_of(self, x: np.ndarray, t: np.ndarray) -> Any:
        loss = F.softmax_cross_entropy(self.model(x), t)
        self._loss = float(loss.array)
        return loss

    @property
    def step(self) -> int:
        return int(self.updater.iteration)

    @step.setter
    def step(self, value: int) -> None:
        self.updater.iteration = int(value)

    @property
    def epoch(self) -> int:
        return self.iterator.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.iterator.epoch = int(value)

    @property
    def position(self) -> int:
        return self.iterator.position

    @position.setter
    def position(self, value: int) -> None:
        self.iterator.position = int(value)

    def train_step(self) -> float:
        with chainer.using_config("train", True):
            self.updater.update()
        if self.comm is None:
            return self._loss
        return float(self.comm.mpi_comm.allreduce(self._loss)) / self.world

    def restart_data(self) -> None:
        """After a restore that kept no data position: the epoch begins again."""
        self.iterator.position = 0

    def unique_state_bytes(self) -> int:
        model = sum(a.nbytes for a in named_arrays(self.model, copy=False).values())
        # Adam keeps two moments per parameter (created at the first update).
        params = sum(p.array.nbytes for p in self.model.params())
        return int(model + 2 * params)

    def param_count(self) -> int:
        return int(sum(p.array.size for p in self.model.params()))

    def final_params(self) -> dict[str, Any]:
        return named_arrays(self.model)

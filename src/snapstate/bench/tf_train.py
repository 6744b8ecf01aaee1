"""One TensorFlow worker's data-parallel training: the study's CIFAR models in Keras.

The same models (CIFAR ResNet-18, VGG-16, width multiplier ``w``), data (synthetic CIFAR-shaped
or the CIFAR-10 binary files), per-rank shards and AdamW as the PyTorch side. With more than one
worker, ``MultiWorkerMirroredStrategy`` (from ``TF_CONFIG``) all-reduces the gradients; its
collectives run beside torch.distributed's gloo group, which snapstate uses.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from snapstate.bench.datasets import normalized_images, shard_order
from snapstate.bench.models import VGG16_LAYOUT, ModelSpec, parse_model

# PyTorch's BatchNorm defaults, so the two sides train the same layer.
BN = {"momentum": 0.9, "epsilon": 1e-5}


def _width(base: int, width: float) -> int:
    return max(4, int(round(base * width)))


def configure_tf(world: int) -> None:
    """Threads and determinism; must run before TensorFlow executes its first op."""
    import tensorflow as tf

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    threads = int(os.environ.get("SNAPSTATE_BENCH_THREADS", max(1, cores // max(1, world))))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()


def _conv_bn(x: Any, filters: int, stride: int, kernel: int = 3) -> Any:
    from tensorflow import keras

    x = keras.layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False)(x)
    return keras.layers.BatchNormalization(**BN)(x)


def _basic_block(x: Any, planes: int, stride: int) -> Any:
    from tensorflow import keras

    out = keras.layers.ReLU()(_conv_bn(x, planes, stride))
    out = _conv_bn(out, planes, 1)
    shortcut = x
    if stride != 1 or x.shape[-1] != planes:
        shortcut = _conv_bn(x, planes, stride, kernel=1)
    return keras.layers.ReLU()(keras.layers.Add()([out, shortcut]))


def resnet18(width: float) -> Any:
    """CIFAR ResNet-18: 3x3 stem without max-pool, four stages of two blocks, average pool."""
    from tensorflow import keras

    inputs = keras.Input((32, 32, 3))
    x = keras.layers.ReLU()(_conv_bn(inputs, _width(64, width), 1))
    for i in range(4):
        for j in range(2):
            x = _basic_block(x, _width(64 * 2**i, width), 2 if i > 0 and j == 0 else 1)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="resnet18")


def vgg16(width: float) -> Any:
    """VGG-16 with batch norm for 32x32 inputs and one linear classifier."""
    from tensorflow import keras

    inputs = keras.Input((32, 32, 3))
    x = inputs
    for item in VGG16_LAYOUT:
        if item == "M":
            x = keras.layers.MaxPooling2D(2)(x)
        else:
            x = keras.layers.ReLU()(_conv_bn(x, _width(int(item), width), 1))
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="vgg16")


KERAS_BUILDERS = {"resnet18": resnet18, "vgg16": vgg16}


def build_keras_model(spec: ModelSpec) -> Any:
    if spec.family not in KERAS_BUILDERS:
        known = ", ".join(sorted(KERAS_BUILDERS))
        raise ValueError(f"model {spec.name!r} has no Keras version; known: {known}")
    return KERAS_BUILDERS[spec.family](float(spec.get("w", "1")))


def make_strategy(world: int) -> Any:
    """MultiWorkerMirroredStrategy when the launcher gave this worker a TF_CONFIG cluster."""
    import tensorflow as tf

    if world > 1:
        cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
        if len(cluster.get("worker", [])) != world:
            raise RuntimeError(f"{world} TensorFlow workers need a TF_CONFIG naming {world}")
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


class KerasTrainer:
    """Keras model, AdamW, this rank's shard of each global batch, flips from tf's generator."""

    device = "cpu"

    def __init__(self, cfg: Any, rank: int, world: int) -> None:
        import tensorflow as tf

        self.cfg, self.rank, self.world = cfg, rank, world
        configure_tf(world)
        self.strategy = make_strategy(world)
        self.spec = parse_model(cfg.model)
        # Weights start equal on every worker; augmentation streams differ by rank.
        tf.keras.utils.set_random_seed(cfg.seed)
        with self.strategy.scope():
            self.model = build_keras_model(self.spec)
            self.optimizer = tf.keras.optimizers.AdamW(learning_rate=cfg.lr, weight_decay=0.01)
            self.optimizer.build(self.model.trainable_variables)
        tf.random.set_global_generator(tf.random.Generator.from_seed(cfg.seed * 1000 + rank))
        self.images, self.labels = normalized_images(
            cfg.samples, cfg.data_dir, cfg.seed, channels_last=True
        )
        self.batches_per_epoch = (len(self.labels) // world) // cfg.batch
        if self.batches_per_epoch < 1:
            raise ValueError(f"{cfg.samples} samples give no batch of {cfg.batch} per rank")
        self.step = 0
        self.epoch = 0
        self.position = 0  # batches of this epoch already taken
        self._step_fn = self._build_step()

    def _build_step(self) -> Any:
        import tensorflow as tf

        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        global_batch = self.cfg.batch * self.world

        def replica_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                logits = self.model(x, training=True)
                loss = tf.nn.compute_average_loss(
                    loss_fn(y, logits), global_batch_size=global_batch
                )
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss

        @tf.function
        def step_fn(x: Any, y: Any) -> Any:
            losses = self.strategy.run(replica_step, args=(x, y))
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

        return step_fn

    def epoch_order(self) -> np.ndarray:
        """This rank's sample indices for the current epoch (a seeded shuffle, then a stride)."""
        n, b = len(self.labels), self.cfg.batch
        return shard_order(n, self.cfg.seed, self.epoch, b, self.rank, self.world)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        b = self.cfg.batch
        idx = self.epoch_order()[self.position * b : (self.position + 1) * b]
        self.position += 1
        return self.images[idx], self.labels[idx]

    def augment(self, x: np.ndarray) -> Any:
        """Random horizontal flips drawn from tf's global generator (so that RNG is state)."""
        import tensorflow as tf

        flip = tf.random.get_global_generator().uniform([x.shape[0]]) < 0.5
        return tf.where(flip[:, None, None, None], tf.reverse(x, axis=[2]), x)

    def train_step(self) -> float:
        x, y = self.next_batch()
        loss = self._step_fn(self.augment(x), y)
        self.step += 1
        return float(loss)

    def restart_data(self) -> None:
        """After a restore that kept no data position: the epoch begins again."""
        self.position = 0

    def _variables(self) -> list[Any]:
        return list(self.model.variables) + list(self.optimizer.variables)

    def unique_state_bytes(self) -> int:
        return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in self._variables()))

    def param_count(self) -> int:
        return int(sum(np.prod(v.shape) for v in self.model.trainable_variables))

    def final_params(self) -> dict[str, Any]:
        """Weights keyed by position and path: Keras numbers layer names per process."""
        return {
            f"{i:04d}_{v.path}": np.array(v.numpy(), copy=True)
            for i, v in enumerate(self.model.variables)
        }

"""Native TensorFlow / Chainer checkpointing beside snapstate's adapters: seconds and bytes on disk.

Run it with the framework's own venv, e.g. ``.venv-tf/bin/python benchmarks/bench_frameworks.py
--mib 64`` or ``.venv-chainer/bin/python benchmarks/bench_frameworks.py --mib 64``. Each method
saves the same model and optimizer once untimed, then ``--repeats`` times, into a fresh directory; the table gives
the median save time, its ratio to the framework's first native method, and the bytes written.
snapstate fsyncs every file and the manifest before a save returns; the native savers do not.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import snapstate as ss

Saver = Callable[[Path], object]


def _bytes_on_disk(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)


def _width(mib: float, layers: int) -> int:
    # float32 weights of `layers` square dense layers; Adam doubles that in its slots
    return max(8, int((mib * 2**20 / 4 / layers) ** 0.5))


def tf_methods(mib: float) -> tuple[int, dict[str, Saver]]:
    import tensorflow as tf

    from snapstate.integrations.tensorflow import stateful

    width, keras = _width(mib, 4), tf.keras
    tf.random.set_global_generator(tf.random.Generator.from_seed(0))
    model = keras.Sequential([keras.Input((width,))])
    for _ in range(4):
        model.add(keras.layers.Dense(width))
    opt = keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    state = stateful(model, opt)
    methods: dict[str, Saver] = {
        "tf.train.Checkpoint": lambda d: ckpt.write(str(d / "ckpt")),
        "tf CheckpointManager": lambda d: tf.train.CheckpointManager(ckpt, str(d), 1).save(),
        "keras save_weights (model only)": lambda d: model.save_weights(str(d / "m.weights.h5")),
        "snapstate save": lambda d: ss.save({"train": state}, d / "ck"),
        "snapstate async_save + wait": lambda d: ss.async_save({"train": state}, d / "ck").wait(),
    }
    nbytes = sum(v.numpy().nbytes for v in model.variables + list(opt.variables))
    return nbytes, methods


def chainer_methods(mib: float) -> tuple[int, dict[str, Saver]]:
    import chainer

    from snapstate.integrations.chainer import stateful

    width = _width(mib, 4)
    net = chainer.Sequential(*[chainer.links.Linear(width, width) for _ in range(4)])
    opt = chainer.optimizers.Adam()
    opt.setup(net)
    x = np.random.default_rng(0).standard_normal((2, width)).astype(np.float32)
    net.cleargrads()
    chainer.functions.sum(net(x)).backward()
    opt.update()  # creates Adam's slots, as a snapshot after the first step would hold

    def npz(d: Path, compression: bool = True) -> None:
        chainer.serializers.save_npz(str(d / "model.npz"), net, compression=compression)
        chainer.serializers.save_npz(str(d / "optimizer.npz"), opt, compression=compression)

    state = stateful(net, opt)
    methods: dict[str, Saver] = {
        "chainer save_npz": npz,
        "chainer save_npz (compression=False)": lambda d: npz(d, compression=False),
        "snapstate save": lambda d: ss.save({"train": state}, d / "ck"),
        "snapstate async_save + wait": lambda d: ss.async_save({"train": state}, d / "ck").wait(),
    }
    sd = state.state_dict()
    nbytes = sum(a.nbytes for part in ("model", "optimizer") for a in sd[part].values())
    return nbytes, methods


def measure(methods: dict[str, Saver], repeats: int, root: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, save in methods.items():
        times, written = [], 0
        # one untimed warm-up: first calls build graphs, thread pools and host buffers
        for i in range(-1, repeats):
            target = root / f"{len(rows)}-{i}"
            target.mkdir(parents=True)
            start = time.perf_counter()
            save(target)
            if i >= 0:
                times.append(time.perf_counter() - start)
            written = _bytes_on_disk(target)
            shutil.rmtree(target)
        rows.append({"method": name, "seconds": statistics.median(times), "bytes": written})
    base = rows[0]["seconds"]
    for row in rows:
        row["ratio"] = row["seconds"] / base if base > 0 else float("nan")
    return rows


def table(framework: str, state_bytes: int, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{framework}: state {state_bytes / 2**20:.1f} MiB",
        "| method | median save s | vs first native | bytes on disk |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['seconds']:.4f} | {r['ratio']:.2f} | {r['bytes']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=64.0, help="model weights, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("tensorflow"):
        framework, (state_bytes, methods) = "tensorflow", tf_methods(args.mib)
    elif importlib.util.find_spec("chainer"):
        framework, (state_bytes, methods) = "chainer", chainer_methods(args.mib)
    else:
        raise SystemExit(
            "neither tensorflow nor chainer is installed: use .venv-tf or .venv-chainer"
        )
    with tempfile.TemporaryDirectory(dir=args.dir or os.environ.get("TMPDIR")) as root:
        rows = measure(methods, args.repeats, Path(root))
    print(table(framework, state_bytes, rows))
    return rows


if __name__ == "__main__":
    main()

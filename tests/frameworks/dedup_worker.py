"""One worker of the multi-worker dedup test: a replicated TF or Chainer model, saved on gloo.

argv: framework rank world_size port checkpoint_dir. Prints one JSON line with this rank's
bytes written and the state's bytes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch.distributed as dist

import snapstate as ss


def tf_state() -> Any:
    import tensorflow as tf

    from snapstate.integrations.tensorflow import stateful

    tf.random.set_global_generator(tf.random.Generator.from_seed(0))
    tf.keras.utils.set_random_seed(0)  # same seed on every worker: replicas agree bit for bit
    model = tf.keras.Sequential([tf.keras.Input((256,))])
    for _ in range(6):
        model.add(tf.keras.layers.Dense(256))
    opt = tf.keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    return stateful(model, opt, rng=False)


def chainer_state() -> Any:
    import chainer

    from snapstate.integrations.chainer import stateful

    np.random.seed(0)
    net = chainer.Sequential(*[chainer.links.Linear(256, 256) for _ in range(6)])
    return stateful(net, rng=False)


def main() -> None:
    framework, rank, world, port, path = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=int(rank), world_size=int(world))
    state = tf_state() if framework == "tensorflow" else chainer_state()
    result = ss.save({"train": state}, path)
    sd = state.state_dict()
    nbytes = sum(np.asarray(a).nbytes for part in sd.values() for a in part.values())
    print(json.dumps({"rank": int(rank), "written": result.bytes_written, "state": nbytes}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

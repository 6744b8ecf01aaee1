"""Sweep configurations: smoke (tests, under a minute), demo (minutes on 2 cores), study (a real machine)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

ALL_METHODS = ("torch-rank0", "torch-allranks", "dcp", "dcp-async", "snapstate", "snapstate-async")
TF_METHODS = (
    "tf-checkpoint",
    "tf-checkpoint-async",
    "keras-modelcheckpoint",
    "snapstate-tf",
    "snapstate-tf-async",
)
CHAINER_METHODS = (
    "chainer-snapshot",
    "chainermn-checkpointer",
    "snapstate-chainer",
    "snapstate-chainer-async",
)
FRAMEWORK_METHODS = ALL_METHODS + TF_METHODS + CHAINER_METHODS
# The fastest peers (pip install -e '.[peers]'): measured beside DCP, torch.save and snapstate
PEER_METHODS = ("torchsnapshot", "torchsnapshot-async", "dlrover-flash")

# Lightning's CheckpointIOs beside snapstate's plug-in and ss.async_save of the same dict
# (make venv-integrations)
INTEGRATION_METHODS = (
    "lightning-torch",
    "lightning-async",
    "lightning-snapstate",
    "lightning-ss-async",
)


@dataclass(frozen=True)
class DeterminismPlan:
    """Which kill-and-resume checks to run: uninterrupted vs killed after ``every`` steps."""

    methods: tuple[str, ...]
    model: str
    ranks: int = 2
    steps: int = 12
    every: int = 4


@dataclass(frozen=True)
class BenchConfig:
    """One sweep: every method x model x ranks x repeat, plus the determinism checks."""

    preset: str
    models: tuple[str, ...]
    ranks: tuple[int, ...]
    methods: tuple[str, ...] = ALL_METHODS
    steps: int = 12
    every: int = 4
    repeats: int = 3
    warmup: int = 3
    batch: int = 16
    samples: int = 2048
    seed: int = 0
    data_dir: str | None = None
    ckpt_dir: str | None = None
    determinism: DeterminismPlan | None = None
    timeout_s: float = 1800.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **changes: Any) -> BenchConfig:
        """Apply command-line options; None means keep the preset's value."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS: dict[str, BenchConfig] = {
    "smoke": BenchConfig(
        preset="smoke",
        models=("resnet18:w=0.125",),
        ranks=(1, 2),
        steps=7,  # three checkpoints, so pruning of old ones runs too
        every=2,
        repeats=1,
        warmup=1,
        batch=8,
        samples=256,
        determinism=DeterminismPlan(("snapstate",), "resnet18:w=0.125", ranks=1, steps=6, every=3),
        timeout_s=300.0,
    ),
    "demo": BenchConfig(
        preset="demo",
        # Small compute, tens of MB of state: checkpoint costs show next to 2-core step times.
        # 26 steps, checkpoints at 4, 8, ..., 24 (6 per run): fewer left the overhead inside
        # the noise (issue 7).
        models=("resnet18:w=0.5",),
        ranks=(1, 2),
        steps=26,
        every=4,
        repeats=2,
        batch=8,
        determinism=DeterminismPlan(ALL_METHODS, "resnet18:w=0.5", ranks=2, steps=10, every=4),
        timeout_s=900.0,
    ),
    "frameworks": BenchConfig(
        preset="frameworks",
        # PyTorch, TensorFlow and Chainer on the same models and data (each framework in its
        # own venv: make venv-tf venv-chainer). Small widths: Chainer trains on numpy.
        models=("resnet18:w=0.25", "vgg16:w=0.125"),
        ranks=(1, 2, 4),
        methods=FRAMEWORK_METHODS,
        steps=10,
        every=3,
        repeats=1,
        warmup=2,
        batch=8,
        samples=512,
        determinism=DeterminismPlan(
            FRAMEWORK_METHODS, "resnet18:w=0.25", ranks=2, steps=8, every=4
        ),
        timeout_s=1200.0,
    ),
    "peers": BenchConfig(
        preset="peers",
        # snapstate beside the fastest peers on a GPT-shaped state (tens of MB on 2 cores)
        models=("gpt:p=10M",),
        ranks=(1, 2),
        methods=("torch-rank0", "dcp", "dcp-async", "snapstate", "snapstate-async") + PEER_METHODS,
        steps=14,
        every=4,
        repeats=2,
        batch=8,
        samples=512,
        determinism=DeterminismPlan(
            ("torchsnapshot", "dlrover-flash", "snapstate"), "gpt:p=10M", ranks=2, steps=8, every=4
        ),
        timeout_s=1200.0,
    ),
    "integrations": BenchConfig(
        preset="integrations",
        # The trainers' own checkpointing on a GPT-shaped state (tens of MB on 2 cores)
        models=("gpt:p=10M",),
        ranks=(1, 2),
        methods=INTEGRATION_METHODS,
        # six checkpoints per segment: with three, the first save's one-time costs (the
        # Trainer's first dump, the first staging buffers) were a third of every median
        steps=26,
        every=4,
        repeats=2,
        batch=8,
        samples=512,
        determinism=DeterminismPlan(INTEGRATION_METHODS, "gpt:p=10M", ranks=2, steps=8, every=4),
        timeout_s=1200.0,
    ),
    "study": BenchConfig(
        preset="study",
        models=("vgg16", "resnet18", "resnet50", "gpt:p=10M", "gpt:p=100M", "gpt:p=1B"),
        ranks=(1, 2, 4, 8),
        methods=ALL_METHODS + PEER_METHODS,
        steps=40,
        every=10,
        repeats=5,
        batch=32,
        samples=8192,
        determinism=DeterminismPlan(ALL_METHODS, "resnet18", ranks=2, steps=40, every=10),
        timeout_s=7200.0,
    ),
}


def get_preset(name: str) -> BenchConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]

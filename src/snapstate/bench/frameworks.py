"""Where each framework's trials run: its interpreter (its own venv), trainer and rank launcher.

TensorFlow and Chainer pin numpy and setuptools against the core environment, so their methods
run in ``.venv-tf`` and ``.venv-chainer`` (``make venv-tf``, ``make venv-chainer``) as
subprocesses; the harness merges their results with PyTorch's into one report.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Framework:
    """One framework: its trainer class, the environment it runs in and how ranks start."""

    name: str
    trainer: str  # "module:Class", imported in the rank process only
    venv: str | None  # venv folder in the project root; None: the harness's own interpreter
    python_env: str  # variable naming the interpreter explicitly (a pip-installed snapstate)
    launcher: str  # "processes": one process per rank; "mpirun": ranks under Open MPI


FRAMEWORKS: dict[str, Framework] = {
    "torch": Framework("torch", "snapstate.bench.train:Trainer", None, "", "processes"),
    "tensorflow": Framework(
        "tensorflow",
        "snapstate.bench.tf_train:KerasTrainer",
        ".venv-tf",
        "SNAPSTATE_TF_PYTHON",
        "processes",
    ),
    # torchsnapshot and DLRover on the same PyTorch trainer, in .venv-peers (make venv-peers)
    "peers": Framework(
        "peers",
        "snapstate.bench.train:Trainer",
        ".venv-peers",
        "SNAPSTATE_PEERS_PYTHON",
        "processes",
    ),
    # Lightning's CheckpointIOs and snapstate's plug-in on the same PyTorch trainer, in
    # .venv-integrations (make venv-integrations)
    "integrations": Framework(
        "integrations",
        "snapstate.bench.train:Trainer",
        ".venv-integrations",
        "SNAPSTATE_INTEGRATIONS_PYTHON",
        "processes",
    ),
    "chainer": Framework(
        "chainer",
        "snapstate.bench.chainer_train:ChainerTrainer",
        ".venv-chainer",
        "SNAPSTATE_CHAINER_PYTHON",
        "mpirun",
    ),
}


def get_framework(name: str) -> Framework:
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}; known: {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


def project_root() -> Path:
    """The checkout snapstate runs from (src/snapstate/bench -> the root)."""
    return Path(__file__).resolve().parents[3]


def python_for(name: str) -> str | None:
    """The interpreter that runs ``name``'s ranks, or None when its environment is missing."""
    fw = get_framework(name)
    if fw.venv is None:
        return sys.executable
    explicit = os.environ.get(fw.python_env)
    if explicit:
        return explicit if Path(explicit).exists() else None
    if Path(sys.prefix).name == fw.venv:  # the harness itself runs in that environment
        return sys.executable
    for root in (Path.cwd(), project_root()):
        candidate = root / fw.venv / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None


def unavailable(name: str) -> str | None:
    """Why ``name``'s methods cannot run here, or None."""
    fw = get_framework(name)
    if python_for(name) is None:
        target = fw.venv.lstrip(".") if fw.venv else name
        return f"no {fw.venv} environment (run `make {target}`, or set {fw.python_env})"
    if fw.launcher == "mpirun" and shutil.which("mpirun") is None:
        return "mpirun not found (Open MPI: apt-get install openmpi-bin libopenmpi-dev)"
    return None


def build_trainer(name: str, cfg: Any, rank: int, world: int) -> Any:
    """The framework's trainer for this rank (in the rank process, inside its environment)."""
    module, cls = get_framework(name).trainer.split(":")
    return getattr(importlib.import_module(module), cls)(cfg, rank, world)

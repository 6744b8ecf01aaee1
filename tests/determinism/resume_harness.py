"""Run the trainer uninterrupted, SIGKILLed mid-epoch, and resumed; compare the runs bit for bit.

Reusable outside the tests: ``kill_and_resume(work, spec)`` returns the three runs, and
``loss_mismatches`` and ``support.bits.tree_differences`` say where two runs differ (empty
lists: identical).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from support.procs import reap_group, wait_for

TRAINER = Path(__file__).with_name("trainer.py")
LOSSES, FINAL, READY = "losses.txt", "final.pt", "ready"
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Spec:
    """One training configuration; ``kill_at`` is a few steps after the checkpoint at ``every``."""

    steps: int = 30
    every: int = 5
    kill_at: int = 18
    workers: int = 0
    seed: int = 0
    reseed: bool = True  # reseed the loader's generator each epoch (see trainer.Batches)

    def argv(self) -> list[str]:
        args = [
            "--steps",
            str(self.steps),
            "--every",
            str(self.every),
            "--workers",
            str(self.workers),
            "--seed",
            str(self.seed),
        ]
        return args if self.reseed else [*args, "--no-reseed"]


@dataclass
class Run:
    """What one trainer process left behind."""

    out: Path
    root: Path
    losses: dict[int, str] = field(default_factory=dict)  # step -> float.hex of the loss

    def reload(self) -> Run:
        self.losses = read_losses(self.out / LOSSES)
        return self

    def final(self) -> dict[str, Any]:
        return torch.load(self.out / FINAL, weights_only=True)


@dataclass
class KillResume:
    reference: Run
    killed: Run
    resumed: Run
    checkpoint_step: int  # the manager's latest committed step when the kill landed


def read_losses(path: Path) -> dict[int, str]:
    losses: dict[int, str] = {}
    for line in path.read_text().splitlines():
        step, value = line.split()
        losses[int(step)] = value
    return losses


def _command(spec: Spec, root: Path, out: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        str(TRAINER),
        "--root",
        str(root),
        "--out",
        str(out),
        *spec.argv(),
        *extra,
    ]


def _start(spec: Spec, root: Path, out: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "stderr.txt", "wb")
    # Own session: data-loader workers orphaned by the kill can be reaped by group afterwards.
    return subprocess.Popen(
        _command(spec, root, out, extra), stdout=log, stderr=log, start_new_session=True
    )


def train(
    spec: Spec, root: Path, out: Path, *, extra: list[str] | None = None, timeout: float = 300.0
) -> Run:
    """Run the trainer to its end in a new process."""
    proc = _start(spec, root, out, extra or [])
    try:
        code = proc.wait(timeout)
    finally:
        reap_group(proc)
    if code != 0:
        raise RuntimeError(
            f"trainer exited with {code}: {(out / 'stderr.txt').read_text()[-3000:]}"
        )
    return Run(out, root).reload()


def train_and_kill(
    spec: Spec, root: Path, out: Path, timeout: float = START_TIMEOUT_S
) -> tuple[Run, int]:
    """Run the trainer until it reports step ``kill_at`` with a committed checkpoint, then SIGKILL it."""
    proc = _start(spec, root, out, ["--kill-at", str(spec.kill_at)])
    ready = out / READY
    try:
        wait_for(
            lambda: ready.exists() or proc.poll() is not None,
            timeout,
            f"the trainer to reach step {spec.kill_at}",
            poll_s=0.02,
        )
        if not ready.exists():
            raise RuntimeError(
                f"trainer ended before the kill: {(out / 'stderr.txt').read_text()[-3000:]}"
            )
        os.kill(proc.pid, signal.SIGKILL)
        code = proc.wait(30)
    finally:
        reap_group(proc)
    if code != -signal.SIGKILL:
        raise RuntimeError(f"trainer was not killed by SIGKILL (exit {code})")
    return Run(out, root).reload(), int(ready.read_text())


def kill_and_resume(work: Path, spec: Spec) -> KillResume:
    """Reference run A; run B killed after ``kill_at``; B resumed from the latest step in a new process."""
    reference = train(spec, work / "a-root", work / "a")
    killed, at = train_and_kill(spec, work / "b-root", work / "b-killed")
    # The resume writes into b-root; ``killed.root`` keeps the checkpoints as the kill left them.
    killed.root = work / "b-root-at-kill"
    shutil.copytree(work / "b-root", killed.root)
    resumed = train(spec, work / "b-root", work / "b-resumed", extra=["--resume"])
    return KillResume(reference, killed, resumed, at)


def resume_copy(spec: Spec, killed: Run, out: Path, extra: list[str]) -> Run:
    """Resume from a copy of ``killed``'s checkpoints (so the original stays usable)."""
    root = out.with_name(out.name + "-root")
    shutil.copytree(killed.root, root)
    return train(spec, root, out, extra=["--resume", *extra])


def stitched(killed: Run, resumed: Run, checkpoint_step: int) -> dict[int, str]:
    """The losses the killed-and-resumed run produced, as one sequence."""
    before = {s: v for s, v in killed.losses.items() if s <= checkpoint_step}
    return before | resumed.losses


def loss_mismatches(want: dict[int, str], got: dict[int, str]) -> list[str]:
    steps = sorted(set(want) | set(got))
    return [f"step {s}: {want.get(s)} != {got.get(s)}" for s in steps if want.get(s) != got.get(s)]

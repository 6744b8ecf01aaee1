"""The plain loop (plain_loop.py) SIGKILLed after a checkpoint and resumed is bit for bit the
uninterrupted run: with and without a loader generator, 0 and 2 workers, killed mid-epoch and
at an epoch boundary, for several epochs after the resume. Nothing in the loop is reseeded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from support.bits import tree_differences
from support.procs import reap_group

from .resume_harness import loss_mismatches, read_losses

LOOP = Path(__file__).with_name("plain_loop.py")
TOTAL = 48  # 4 epochs of 12 steps; checkpoints every 4 steps
MID_EPOCH, BOUNDARY = 18, 24  # killed after step 18 (checkpoint 16) or right after checkpoint 24


@dataclass(frozen=True)
class Case:
    generator: bool
    workers: int

    def flags(self) -> list[str]:
        flags = ["--workers", str(self.workers)]
        flags += ["--generator"] if self.generator else []
        return flags + (["--wrap"] if self.workers else [])  # the offered fix for worker draws


def _start(root: Path, out: Path, flags: list[str]) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "stderr.txt", "wb")
    cmd = [sys.executable, str(LOOP), "--root", str(root), "--out", str(out), *flags]
    return subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)


def train(root: Path, out: Path, flags: list[str]) -> dict[int, str]:
    proc = _start(root, out, flags)
    try:
        code = proc.wait(180)
    finally:
        reap_group(proc)
    assert code == 0, (out / "stderr.txt").read_text()[-3000:]
    return read_losses(out / "losses.txt")


def train_and_kill(
    root: Path, out: Path, flags: list[str], kill_at: int
) -> tuple[dict[int, str], int]:
    """Run until step ``kill_at`` has a committed checkpoint behind it, then SIGKILL."""
    proc = _start(root, out, [*flags, "--kill-at", str(kill_at)])
    deadline = time.monotonic() + 180
    try:
        while not (out / "ready").exists():
            assert proc.poll() is None, (out / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer did not reach the kill"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        reap_group(proc)
    return read_losses(out / "losses.txt"), int((out / "ready").read_text())


def final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)


def check_resume(work: Path, case: Case, reference: Path, kill_at: int) -> None:
    root = work / f"root-{kill_at}"
    killed, at = train_and_kill(root, work / f"killed-{kill_at}", case.flags(), kill_at)
    assert at == kill_at - kill_at % 4 and max(killed) == kill_at
    resumed = train(root, work / f"resumed-{kill_at}", [*case.flags(), "--resume"])
    assert min(resumed) == at + 1  # resumed from the checkpoint, epochs after it included
    want = read_losses(reference / "losses.txt")
    assert sorted(want) == list(range(1, TOTAL + 1))
    assert loss_mismatches(want, {s: v for s, v in killed.items() if s <= at} | resumed) == []
    assert loss_mismatches({s: want[s] for s in killed}, killed) == []
    a, b = final(reference), final(work / f"resumed-{kill_at}")
    assert tree_differences(a, b) == []


CASES = [Case(False, 0), Case(True, 0), Case(False, 2), Case(True, 2)]
References = Callable[[list[str]], Path]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The uninterrupted run of a configuration, run once per module."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(flags: list[str]) -> Path:
        if tuple(flags) not in runs:
            work = tmp_path_factory.mktemp("reference")
            train(work / "root", work / "out", flags)
            runs[tuple(flags)] = work / "out"
        return runs[tuple(flags)]

    return run


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"gen{int(c.generator)}-workers{c.workers}")
def test_killed_mid_epoch_and_at_an_epoch_boundary_resume_bitwise(
    case: Case, reference: References, tmp_path: Path
) -> None:
    ref = reference(case.flags())
    check_resume(tmp_path, case, ref, MID_EPOCH)
    check_resume(tmp_path, case, ref, BOUNDARY)


def _diverges(
    tmp_path: Path, reference: References, flags: list[str], extra: list[str]
) -> list[str]:
    want = read_losses(reference(flags) / "losses.txt")
    root = tmp_path / "root"
    _, at = train_and_kill(root, tmp_path / "killed", flags, MID_EPOCH)
    got = train(root, tmp_path / "resumed", [*flags, "--resume", "--no-save", *extra])
    assert min(got) == at + 1
    common = [s for s in got if s in want]  # without the loader's state the epoch starts over
    return loss_mismatches({s: want[s] for s in common}, {s: got[s] for s in common})


@pytest.mark.parametrize("skip", ["rng", "loader"])
def test_negative_control_resume_without_rng_or_loader_state_diverges(
    skip: str, reference: References, tmp_path: Path
) -> None:
    after = _diverges(tmp_path, reference, Case(True, 0).flags(), ["--skip", skip])
    assert len(after) >= 20, f"a resume without {skip} must diverge: {after}"


def test_negative_control_worker_draws_without_the_wrapper_diverge_and_warn(
    reference: References, tmp_path: Path
) -> None:
    """Random draws inside workers are not in torchdata's state: saving warns, the resume differs."""
    after = _diverges(tmp_path, reference, ["--workers", "2", "--generator"], [])
    assert len(after) >= 20, after
    warned = (tmp_path / "killed" / "stderr.txt").read_text()
    assert "WorkerRandomnessWarning" in warned and "snapstate.data.WorkerRNG" in warned
    assert warned.count("WorkerRandomnessWarning") == 1  # once, not at every save

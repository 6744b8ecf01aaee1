"""Parent side of the kill tests: start savers, SIGKILL them, and check what a kill left behind."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from click.testing import CliRunner

import snapstate as ss
from snapstate.cli import main as cli_main
from snapstate.manager import STEP_DIR, step_dir
from snapstate.references import referenced, steps_holding
from snapstate.storage.base import storage_for
from support.procs import LineServer

from .saver_child import blank_state, make_state, state_differences

States = Callable[[int], dict[str, Any]]

CHILD = str(Path(__file__).with_name("saver_child.py"))


class ForkServer(LineServer):
    """A saver process that imported torch once and forks one child per run."""

    def __init__(self) -> None:
        super().__init__(CHILD, "serve")

    def start(self, run: dict[str, Any]) -> int:
        return int(self.ask({"run": run})["pid"])

    def kill(self, pid: int) -> int:
        """SIGKILL the child and reap it: once this returns, the process is gone."""
        return int(self.ask({"kill": pid})["status"])

    def wait(self, pid: int) -> int:
        return int(self.ask({"wait": pid})["status"])


@dataclass
class Run:
    """One saver run: where it writes, what it logs, where it signals a pause."""

    root: Path
    work: Path
    mode: str
    first: int | None
    steps: int
    pause: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def progress(self) -> Path:
        return self.work / "progress.log"

    @property
    def signal(self) -> Path:
        return self.work / "paused.json"

    def describe(self) -> dict[str, Any]:
        for p in (self.progress, self.signal):
            p.unlink(missing_ok=True)
        return {
            "root": str(self.root),
            "mode": self.mode,
            "first": self.first,
            "steps": self.steps,
            "pause": self.pause,
            "signal": str(self.signal),
            "progress": str(self.progress),
            **self.extra,
        }

    def log(self) -> list[str]:
        return self.progress.read_text().splitlines() if self.progress.exists() else []

    def committed(self) -> list[int]:
        """Steps the child saw committed before it died."""
        return [int(line.split()[1]) for line in self.log() if line.startswith("committed ")]

    def errors(self) -> list[str]:
        return [line for line in self.log() if line.startswith("error ") or " BAD " in line]


@dataclass
class RootReport:
    committed: list[int]
    uncommitted: list[int]


def check_root(root: Path, states: States = make_state) -> RootReport:
    """Every step directory is committed and exact, or invisible; the CLI agrees (``states``:
    what the saver saved at each step)."""
    report = RootReport([], [])
    for name in sorted(os.listdir(root)):
        match = STEP_DIR.match(name)
        if not match:
            continue
        step, path = int(match.group(1)), root / name
        if (path / "manifest.json").exists():
            ss.verify(path)
            target = blank_state()
            ss.load(target, path)
            bad = state_differences(target, states(step))
            assert not bad, f"{name} is committed but differs from what was saved: {bad}"
            report.committed.append(step)
        else:
            try:
                ss.load(blank_state(), path)
            except ss.CheckpointNotFoundError:
                pass
            else:
                raise AssertionError(f"{name} has no manifest.json but loaded")
            report.uncommitted.append(step)
    _check_ls(root, report)
    return report


def _check_ls(root: Path, report: RootReport) -> None:
    result = CliRunner().invoke(cli_main, ["ls", str(root)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    states = {}
    for line in result.output.splitlines():
        cells = [c.strip() for c in line.replace("┃", "│").split("│") if c.strip()]
        if len(cells) >= 2 and cells[0].isdigit():
            states[int(cells[0])] = cells[1]
    expected = {s: "committed" for s in report.committed} | {
        s: _uncommitted_state(root, s, report.committed) for s in report.uncommitted
    }
    assert states == expected, f"`snapstate ls` says {states}, expected {expected}"


def recover(root: Path, before: RootReport, states: States = make_state) -> int | None:
    """What a restarted job does: a new manager removes leftovers and restores the latest step.

    Of a directory without a manifest only files that committed steps reference may remain
    (steps deleted by retention whose bytes incremental steps still use)."""
    latest = max(before.committed, default=None)
    with ss.CheckpointManager(root, keep_last=None, async_save=False) as mgr:
        needed = referenced(mgr.storage, [f"step-{s:09d}" for s in mgr.steps()])
        leftovers = [
            str(path.relative_to(root))
            for n in os.listdir(root)
            if STEP_DIR.match(n) and not (root / n / "manifest.json").exists()
            for path in [root / n, *(root / n).rglob("*")]
            if not path.is_dir() or not any(path.iterdir())
            if str(path.relative_to(root)) not in needed
        ]
        assert not leftovers, f"manager left uncommitted files behind: {leftovers}"
        assert mgr.steps() == sorted(before.committed)
        state = blank_state()
        restored = mgr.restore(state)
        assert restored == latest, f"restore() returned {restored}, latest committed is {latest}"
        if restored is not None:
            assert not state_differences(state, states(restored))
    return latest


def prune(root: Path, keep: int) -> None:
    """Test housekeeping between kills (no child running): keep the newest ``keep`` steps."""
    steps = sorted(int(m.group(1)) for n in os.listdir(root) if (m := STEP_DIR.match(n)))
    for step in steps[:-keep] if keep else steps:
        shutil.rmtree(root / f"step-{step:09d}")


def _uncommitted_state(root: Path, step: int, committed: list[int]) -> str:
    """What `ls` says of a step without a manifest: a leftover, or (incremental saves) a step
    retention deleted whose files committed steps still reference."""
    shared = referenced(storage_for(str(root)), [step_dir(s) for s in committed])
    if step_dir(step) in steps_holding(shared):
        return "deleted (files referenced by later steps kept)"
    return "uncommitted"

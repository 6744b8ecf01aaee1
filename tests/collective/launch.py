"""Parent side of the distributed tests: run a job of N ranks and collect what each returned."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.procs import LineServer

SERVER = str(Path(__file__).with_name("rankserver.py"))


@dataclass
class JobResult:
    codes: list[int]
    results: list[Any]  # what each rank returned (None for a rank that did not finish)
    logs: list[str]
    timed_out: bool

    def check(self) -> list[Any]:
        """Every rank exited 0; their results."""
        if self.timed_out or any(self.codes):
            raise AssertionError(self.describe())
        return self.results

    def describe(self) -> str:
        parts = [f"exit codes {self.codes}{' (timed out)' if self.timed_out else ''}"]
        for rank, log in enumerate(self.logs):
            parts.append(f"--- rank {rank} log (tail) ---\n{log[-3000:]}")
        return "\n".join(parts)


class RankServer(LineServer):
    """One server per test session: torch is imported once, ranks are forked from it."""

    def __init__(self) -> None:
        super().__init__(SERVER, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def run(
        self, fn: str, world: int, args: dict[str, Any], work: Path, timeout: float = 90.0
    ) -> JobResult:
        """Run ``fn(rank, world, args)`` on ``world`` ranks (0: one process without a group)."""
        work.mkdir(parents=True, exist_ok=True)
        for stale in [*work.glob("result-*.json"), *work.glob("rank*.log"), work / "store-port"]:
            stale.unlink(missing_ok=True)
        job = {"fn": fn, "world": world, "args": args, "work": str(work), "timeout": timeout}
        reply = self.ask(job, timeout=timeout + 30)
        n = max(world, 1)
        return JobResult(
            reply["codes"],
            [_read_json(work / f"result-{r}.json") for r in range(n)],
            [_read_text(work / f"rank{r}.log") for r in range(n)],
            reply["timed_out"],
        )


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""

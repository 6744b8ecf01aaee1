"""Driving one harness method by hand, as a test of a framework's trainer does."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_after_steps(trainer: Any, name: str, path: Path, steps: int = 3) -> None:
    """Train ``steps`` steps, then save with method ``name`` on one rank and wait for it."""
    from snapstate.bench.methods import get_method

    for _ in range(steps):
        trainer.train_step()
    method = get_method(name)(0, 1)
    method.save(trainer, path)
    method.close()


def load_with(name: str, trainer: Any, path: Path) -> None:
    """Restore ``trainer`` from ``path`` with a fresh instance of method ``name``."""
    from snapstate.bench.methods import get_method

    get_method(name)(0, 1).load(trainer, path)

"""Skip marks for tests that need a trainer package from `make venv-integrations`."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.procs import LineServer


def needs(*packages: str) -> pytest.MarkDecorator:
    """Skip unless every package is importable (they live in `.venv-integrations`)."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"needs {', '.join(missing)}: make test-integrations"
    )


def recipe(doc: Path, heading: str) -> str:
    """The first ```python block under ``## heading`` in ``doc``: the recipe a test runs as written."""
    text = doc.read_text()
    start = text.index(f"\n## {heading}\n")
    block = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert block, f"{doc}: no python block under '## {heading}'"
    return block.group(1)


def trainer_server(script: str) -> Iterator[LineServer]:
    """A fork server of the trainer runs (``*_train.py``), closed when the generator ends."""
    server = LineServer(script, env=dict(os.environ, OMP_NUM_THREADS="1"))
    yield server
    server.close()


def run_job(config: dict[str, Any], main: Callable[[dict[str, Any]], None]) -> None:
    """``main(config)``, or a recipe of docs/integrations.md (``config["script"]``) as written."""
    if "script" in config:
        os.chdir(config["out"])
        exec(compile(config["script"], "recipe.py", "exec"), {"__name__": "__main__"})
    else:
        main(config)


def exit_after(log: Path, body: Callable[[], None]) -> None:
    """In a forked run: ``body()`` with its output in ``log``, then exit (1 if it raised)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 0
    try:
        body()
    except BaseException:  # noqa: BLE001 - reported through the exit code and the log
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

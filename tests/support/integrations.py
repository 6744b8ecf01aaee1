"""Skip marks for tests that need a trainer package from `make venv-integrations`."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest


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

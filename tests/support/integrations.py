"""Skip marks for tests that need a trainer package from `make venv-integrations`."""

from __future__ import annotations

import importlib.util

import pytest


def needs(*packages: str) -> pytest.MarkDecorator:
    """Skip unless every package is importable (they live in `.venv-integrations`)."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"needs {', '.join(missing)}: make test-integrations"
    )

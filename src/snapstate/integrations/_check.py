"""Shared checks of adapters: every missing, extra or misshapen array of a framework state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from snapstate.errors import IncompatibleStateError, StateMismatch


def mismatches(
    prefix: str, want: Mapping[str, Any], got: Mapping[str, Any], extra_ok: bool = False
) -> list[StateMismatch]:
    """Differences between the target's arrays ``want`` and the checkpoint's ``got``."""
    out = [StateMismatch.missing(f"{prefix}/{k}") for k in want if k not in got]
    if not extra_ok:
        out += [StateMismatch(f"{prefix}/{k}", "not in the target") for k in got if k not in want]
    for key in want.keys() & got.keys():
        w, g = np.shape(want[key]), np.shape(got[key])
        if w != g:
            out.append(StateMismatch(f"{prefix}/{key}", f"shape {g} in checkpoint, {w} in target"))
    return out


def raise_if_any(what: str, found: list[StateMismatch]) -> None:
    # Raised before any variable is assigned, so a failed load leaves the framework state as it was.
    if found:
        raise IncompatibleStateError(what, sorted(found, key=lambda m: m.key))

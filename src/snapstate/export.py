"""Export: a (possibly sharded) checkpoint consolidated to one torch or safetensors file."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from snapstate.engine.readstate import read_available
from snapstate.engine.verify import read_manifest
from snapstate.errors import CheckpointError, CheckpointExistsError
from snapstate.state.flatten import join_key
from snapstate.storage.base import storage_for

Say = Callable[[str], None]  # where an export's notes go (the CLI prints them on stderr)
log = logging.getLogger("snapstate.export")

# What torch.load(weights_only=True) accepts besides tensors, containers and JSON scalars.
_PLAIN = (bool, int, float, str, type(None))
_TORCH_TYPED = (torch.dtype, torch.device, torch.Size)
_LEFT_OUT: Any = object()  # internal: a leaf the file cannot hold, never written


class ExportError(CheckpointError, ValueError):
    """The checkpoint (or the key asked for) cannot be exported as asked."""


def export_checkpoint(
    path: str | os.PathLike[str],
    to: Literal["torch", "safetensors"],
    out: str | os.PathLike[str],
    say: Say = log.info,
) -> int:
    """Write the consolidated state to the file ``out``; returns the number of tensors written.

    Per-rank state (loaders, RNG) belongs to no single file and is left out, as are values the
    format cannot hold; ``say`` gets one line naming what was left out. ``torch`` writes
    tensors, plain values, dtypes, devices, sizes and sets, loadable with
    ``torch.load(weights_only=True)``; ``safetensors`` writes the tensors (a tied one under
    each of its names) and the JSON values as JSON in the metadata under ``values``.
    """
    if to not in ("torch", "safetensors"):
        raise ValueError(f"unknown export format {to!r}; use 'torch', 'safetensors' or 'hf'")
    storage = storage_for(path)
    with new_file(Path(out)) as tmp:  # read first: a failed read leaves nothing at ``out``
        state, unread = read_available(storage, read_manifest(storage), None, None)
        kept, dropped = _split(state, "", torch_typed=to == "torch")
        kept = {} if kept is _LEFT_OUT else kept
        dropped = [m.key for m in unread] + dropped
        if dropped:
            say(f"left out (per-rank state, or not storable in {to}): {', '.join(dropped)}")
        if to == "torch":
            torch.save(kept, tmp)
            return sum(1 for _, leaf in flat_items(kept, "") if isinstance(leaf, torch.Tensor))
        return _save_safetensors(kept, tmp)


def _save_safetensors(kept: Any, out: Path) -> int:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    seen: set[int] = set()
    for key, leaf in flat_items(kept, ""):
        if not isinstance(leaf, torch.Tensor):
            values[key] = leaf
            continue
        # safetensors refuses tensors that share memory: a tied weight is written per name
        tensors[key] = leaf.clone() if id(leaf) in seen else leaf.contiguous()
        seen.add(id(leaf))
    meta = {"format": "snapstate-export", "values": json.dumps(values)}
    save_file(tensors, os.fspath(out), metadata=meta)
    return len(tensors)


def _split(value: Any, prefix: str, torch_typed: bool) -> tuple[Any, list[str]]:
    """(what the file holds: tensors, plain values and containers of them, numpy as torch;
    the keys of the rest, left out: gone from dicts, None in lists)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.from_numpy(np.ascontiguousarray(value)), []
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return value, []
    if torch_typed and (isinstance(value, _TORCH_TYPED) or _plain_set(value)):
        return value, []
    if type(value) not in (dict, list, tuple):
        return _LEFT_OUT, [f"{prefix or '<root>'} ({type(value).__name__})"]
    dropped: list[str] = []

    def keep(k: Any, v: Any) -> Any:
        sub, lost = _split(v, join_key(prefix, k), torch_typed)
        dropped.extend(lost)
        return sub

    if isinstance(value, dict):
        kept = {k: sub for k, v in value.items() if (sub := keep(k, v)) is not _LEFT_OUT}
        return kept, dropped
    seq = [keep(i, v) for i, v in enumerate(value)]
    return type(value)(None if s is _LEFT_OUT else s for s in seq), dropped


def _plain_set(value: Any) -> bool:
    return type(value) is set and all(type(v) in _PLAIN for v in value)


def flat_items(value: Any, prefix: str, sep: str = "/") -> list[tuple[str, Any]]:
    """Leaves of nested dicts and sequences by joined key (``/`` escapes as in the manifest)."""

    def join(k: Any) -> str:
        return join_key(prefix, k) if sep == "/" else f"{prefix}{sep}{k}" if prefix else str(k)

    if isinstance(value, dict):
        return [item for k, v in value.items() for item in flat_items(v, join(k), sep)]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in flat_items(v, join(i), sep)]
    return [(prefix, value)]


def refuse_existing(out: Path, empty_dir_ok: bool = False) -> None:
    """An export never replaces what is at ``out``: say so in one line instead."""
    if out.is_dir() and empty_dir_ok and not any(out.iterdir()):
        return
    if out.is_dir():
        kind = "a directory that is not empty" if empty_dir_ok else "a directory"
        raise CheckpointExistsError(f"{out} is {kind}; export to a new path")
    if out.exists() or out.is_symlink():
        raise CheckpointExistsError(f"{out} exists; remove it or export to a new path")


@contextmanager
def new_file(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write, renamed to ``out`` once complete: a failed
    export leaves nothing behind."""
    refuse_existing(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        refuse_existing(out)  # nobody wrote it meanwhile
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def new_dir(out: Path) -> Iterator[Path]:
    """As :func:`new_file` for a directory; an empty directory at ``out`` may be filled."""
    refuse_existing(out, empty_dir_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        refuse_existing(out, empty_dir_ok=True)
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

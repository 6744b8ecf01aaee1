"""Export: a (possibly sharded) checkpoint consolidated to one torch or safetensors file, or
one key of it (the model) to the Hugging Face layout that ``from_pretrained`` reads."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from snapstate.engine.readstate import read_available, read_plain
from snapstate.engine.verify import read_manifest
from snapstate.errors import CheckpointError, CheckpointExistsError
from snapstate.state.flatten import join_key
from snapstate.storage.base import storage_for

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
Say = Callable[[str], None]  # where an export's notes go (the CLI prints them)


class ExportError(CheckpointError, ValueError):
    """The checkpoint (or the key asked for) cannot be exported as asked."""


def export_checkpoint(
    path: str | os.PathLike[str],
    to: Literal["torch", "safetensors"],
    out: str | os.PathLike[str],
    say: Say = lambda _: None,
) -> int:
    """Write the consolidated state to the file ``out``; returns the number of tensors written.

    Per-rank state (loaders, RNG) belongs to no single file and is left out, as are values the
    format cannot hold; ``say`` gets one line naming what was left out. ``--to torch`` writes
    tensors and plain values, loadable with ``torch.load(weights_only=True)``; ``--to
    safetensors`` writes the tensors, the plain values as JSON in the metadata.
    """
    if to not in ("torch", "safetensors"):
        raise ValueError(f"unknown export format {to!r}; use 'torch', 'safetensors' or 'hf'")
    _refuse_existing(Path(out))
    storage = storage_for(path)
    state, unread = read_available(storage, read_manifest(storage), None, None)
    kept, dropped = _split(state, "")
    kept = {} if kept is _LEFT_OUT else kept
    dropped = [m.key for m in unread] + dropped
    if dropped:
        say(f"left out (per-rank state or not {to}-storable): {', '.join(dropped)}")
    if to == "torch":
        torch.save(kept, out)
        return sum(1 for _, leaf in _flat_items(kept, "") if isinstance(leaf, torch.Tensor))
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for key, leaf in _flat_items(kept, ""):
        if isinstance(leaf, torch.Tensor):
            tensors[key] = leaf.contiguous()
        else:
            values[key] = leaf
    _save_unshared(
        save_file, tensors, Path(out), {"format": "snapstate-export", "values": json.dumps(values)}
    )
    return len(tensors)


def export_hf(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    key: str = "model",
    config: str | os.PathLike[str] | None = None,
    max_shard_size: int = 5 * 10**9,
    say: Say = lambda _: None,
) -> list[str]:
    """Write the state dict under ``key`` to ``out_dir`` as ``from_pretrained`` reads it.

    ``model.safetensors`` with the names of the module's ``state_dict`` (no ``key/`` prefix),
    or shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` when
    larger than ``max_shard_size`` bytes; a tied weight (stored once, as an alias) is written
    once under its first name, as transformers' ``save_pretrained`` does, and ``from_pretrained``
    ties it again. ``config`` (a config.json) is copied beside it. Returns the files written.
    """
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any((out / n).exists() for n in (HF_WEIGHTS, HF_INDEX)):
        raise CheckpointExistsError(
            f"{out} already holds an export ({HF_WEIGHTS}); pick another directory"
        )
    if config is not None and not Path(config).is_file():
        raise ExportError(f"config {config} is not a file")
    storage = storage_for(path)
    value = read_plain(storage, read_manifest(storage), [key], None)[key]
    tensors = _model_tensors(value, key, say)
    out.mkdir(parents=True, exist_ok=True)
    written = _write_hf_shards(tensors, out, max_shard_size)
    if config is not None:
        shutil.copyfile(config, out / "config.json")
        written.append("config.json")
    return written


def _model_tensors(value: Any, key: str, say: Say) -> dict[str, torch.Tensor]:
    """The state dict's tensors by name, each tied one once (under its first name)."""
    if not isinstance(value, dict):
        raise ExportError(f"{key!r} holds a {type(value).__name__}, not a model's state dict")
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    left_out, tied = [], []
    for name, leaf in _flat_items(value, "", sep="."):
        if isinstance(leaf, np.ndarray):
            leaf = torch.from_numpy(np.ascontiguousarray(leaf))
        if not isinstance(leaf, torch.Tensor):
            left_out.append(name)
        elif id(leaf) in seen:  # an alias: read back as the same tensor
            tied.append(f"{name} (= {seen[id(leaf)]})")
        else:
            seen[id(leaf)] = name
            tensors[name] = leaf.contiguous()
    if not tensors:
        raise ExportError(f"{key!r} holds no tensors to export")
    if tied:
        say(f"tied weights written once: {', '.join(tied)}")
    if left_out:
        say(f"left out (not tensors): {', '.join(left_out)}")
    return tensors


def _write_hf_shards(tensors: dict[str, torch.Tensor], out: Path, limit: int) -> list[str]:
    from safetensors.torch import save_file

    shards = _shard(tensors, limit)
    meta = {"format": "pt"}  # what transformers writes and checks
    if len(shards) == 1:
        save_file(tensors, out / HF_WEIGHTS, metadata=meta)
        return [HF_WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file({k: tensors[k] for k in shard}, out / name, metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    index = {
        "metadata": {
            "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
            "total_parameters": sum(t.numel() for t in tensors.values()),
        },
        "weight_map": weight_map,
    }
    (out / HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, HF_INDEX]


def _shard(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _refuse_existing(out: Path) -> None:
    if out.is_dir():
        raise CheckpointExistsError(
            f"{out} is a directory; export writes one file (or use --to hf)"
        )
    if out.exists():
        raise CheckpointExistsError(f"{out} exists; remove it or pick another path")


def _save_unshared(
    save: Any, tensors: dict[str, torch.Tensor], out: Path, meta: dict[str, str]
) -> None:
    """safetensors refuses tensors that share memory: a tied weight is written twice there."""
    seen: set[int] = set()
    for key, t in tensors.items():
        if id(t) in seen:
            tensors[key] = t.clone()
        seen.add(id(t))
    save(tensors, os.fspath(out), metadata=meta)


_PLAIN = (bool, int, float, str, type(None))
_LEFT_OUT: Any = object()  # internal: a leaf the file cannot hold, never written


def _split(value: Any, prefix: str) -> tuple[Any, list[str]]:
    """(what a weights-only file holds: tensors, plain values and containers of them; the
    keys of the rest, typed values, left out: gone from dicts, None in lists)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.from_numpy(np.ascontiguousarray(value)), []
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return value, []
    if type(value) not in (dict, list, tuple):
        return _LEFT_OUT, [prefix or "<root>"]
    dropped: list[str] = []

    def keep(k: Any, v: Any) -> Any:
        sub, lost = _split(v, join_key(prefix, k))
        dropped.extend(lost)
        return sub

    if isinstance(value, dict):
        kept = {k: sub for k, v in value.items() if (sub := keep(k, v)) is not _LEFT_OUT}
        return kept, dropped
    seq = [keep(i, v) for i, v in enumerate(value)]
    return type(value)(None if s is _LEFT_OUT else s for s in seq), dropped


def _flat_items(value: Any, prefix: str, sep: str = "/") -> list[tuple[str, Any]]:
    def join(k: Any) -> str:
        return join_key(prefix, k) if sep == "/" else f"{prefix}.{k}" if prefix else str(k)

    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flat_items(v, join(k), sep)]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in _flat_items(v, join(i), sep)]
    return [(prefix, value)]

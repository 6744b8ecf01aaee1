"""Export one key of a checkpoint (the model) in the Hugging Face layout ``from_pretrained`` reads."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from snapstate.engine.readstate import read_plain
from snapstate.engine.verify import read_manifest
from snapstate.export import ExportError, Say, flat_items, log, new_dir
from snapstate.storage.base import storage_for

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # save_pretrained's default in transformers 4 (5.x: 50GB)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def export_hf(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    key: str = "model",
    config: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    say: Say | None = None,
) -> list[str]:
    """Write the state dict under ``key`` to the new directory ``out_dir`` as
    ``from_pretrained`` reads it; returns the names of the files written.

    ``model.safetensors`` holds the module's ``state_dict`` names (no ``key/`` prefix); above
    ``max_shard_size`` (bytes, or ``"5GB"``, ``"500MiB"``: transformers' notation) the tensors
    go to ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``. A tied
    weight, which the checkpoint stores once as an alias, is written once under its first name
    in the state dict (the input embedding before the output head); transformers'
    ``save_pretrained`` drops the model's ``_tied_weights_keys`` the same way, and
    ``from_pretrained`` ties them again. ``config`` (a
    config.json) is copied beside it. Values that are not tensors are left out and named in a
    note to ``say`` (default: the ``snapstate.export`` logger). ``out_dir`` must not exist or
    be empty; a failed export leaves nothing there.
    """
    limit = parse_size(max_shard_size)
    if config is not None and not Path(config).is_file():
        raise ExportError(f"--config {config} is not a file")
    storage = storage_for(path)
    with new_dir(Path(out_dir)) as tmp:
        value = read_plain(storage, read_manifest(storage), [key], None)[key]
        tensors = model_tensors(value, key, say or log.info)
        written = write_shards(tensors, tmp, limit)
        if config is not None:
            shutil.copyfile(config, tmp / "config.json")
            written.append("config.json")
        return written


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size such as ``"5GB"`` (10**9) or ``"5GiB"`` (2**30)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or isinstance(size, bool):
        raise ValueError(f"max shard size {size!r} is not a size such as 5GB, 500MB or 1GiB")
    n = int(match.group(1)) * _UNITS[unit]
    if n <= 0:
        raise ValueError(f"max shard size must be positive, got {size!r}")
    return n


def model_tensors(value: Any, key: str, say: Say) -> dict[str, torch.Tensor]:
    """The state dict's tensors by name, a tied one once, under its first name: the read
    gives every alias of a stored tensor the same tensor object."""
    if not isinstance(value, dict):
        raise ExportError(
            f"key {key!r} holds a value of type {type(value).__name__}, not a state dict"
        )
    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    left_out, tied = [], []
    for name, leaf in flat_items(value, "", sep="."):
        if isinstance(leaf, np.ndarray):
            leaf = torch.from_numpy(np.ascontiguousarray(leaf))
        if not isinstance(leaf, torch.Tensor):
            left_out.append(f"{name} ({type(leaf).__name__})")
        elif id(leaf) in first:
            tied.append(f"{name} (= {first[id(leaf)]})")
        else:
            first[id(leaf)] = name
            tensors[name] = leaf.contiguous()
    if not tensors:
        raise ExportError(f"key {key!r} holds no tensors to export")
    if tied:
        say(f"tied weights written once: {', '.join(tied)}")
    if left_out:
        say(f"left out (not tensors): {', '.join(left_out)}")
    return tensors


def write_shards(tensors: dict[str, torch.Tensor], out: Path, limit: int) -> list[str]:
    """One file, or shards of at most ``limit`` bytes and their index; the names written."""
    from safetensors.torch import save_file

    shards = shard_names(tensors, limit)
    meta = {"format": "pt"}  # transformers reads only files that say so
    if len(shards) == 1:
        save_file(tensors, out / HF_WEIGHTS, metadata=meta)
        return [HF_WEIGHTS]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file, names in zip(files, shards):
        save_file({n: tensors[n] for n in names}, out / file, metadata=meta)
        weight_map.update(dict.fromkeys(names, file))
    index = {
        "metadata": {
            "total_size": sum(_nbytes(t) for t in tensors.values()),
            "total_parameters": sum(t.numel() for t in tensors.values()),
        },
        "weight_map": weight_map,
    }
    (out / HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*files, HF_INDEX]


def shard_names(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(t)
    return shards


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

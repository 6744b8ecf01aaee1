"""A synthetic results document in the snapstate-bench/1 schema, for report tests."""

from __future__ import annotations

from typing import Any

from snapstate.bench.methods import METHODS
from snapstate.bench.presets import get_preset
from snapstate.bench.results import SCHEMA


def record(
    method: str, model: str, ranks: int, repeat: int, unique: int = 1_000_000
) -> dict[str, Any]:
    copies = ranks if method == "torch-allranks" else 1
    per_rank = [unique] * ranks if copies > 1 else [unique // ranks] * ranks
    if method == "torch-rank0":
        per_rank = [unique] + [0] * (ranks - 1)
    blocking = 0.01 * (1 + repeat) if "async" in method else 0.05 * ranks
    return {
        "method": method,
        "model": model,
        "ranks": ranks,
        "repeat": repeat,
        "unique_state_bytes": unique,
        "bytes_on_disk": sum(per_rank),
        "files": ranks,
        "bytes_per_rank": per_rank,
        "blocking_s": blocking,
        "save_s": 0.05 * ranks + 0.01,
        "persist_s": 0.05 * ranks + 0.01 - blocking,
        "load_s": 0.02,
        "train_step_s": 0.1,
        "overhead_pct": 3.0 * ranks - repeat,
        "peak_rss_bytes": 300_000_000,
        "deterministic": None,
        "rss_added_bytes": 1_000_000,
        "baseline_step_s": 0.1,
        "save_s_per_rank": [0.05] * ranks,
        "raw_write_bytes_per_s": 1e9,
        "write_bytes_per_s": 2e8,
        "model_params": unique // 12,
        "format": METHODS[method].info.format,
        "largest_file_bytes": max(per_rank),
    }


def document(
    methods: tuple[str, ...] = ("torch-rank0", "torch-allranks", "snapstate-async"),
) -> dict[str, Any]:
    records = [
        record(m, model, n, r)
        for m in methods
        for model in ("resnet18:w=0.5", "gpt:p=3M")
        for n in (1, 2, 4)
        for r in range(3)
    ]
    checks = [
        {
            "method": "snapstate",
            "model": "resnet18:w=0.5",
            "ranks": 2,
            "steps": 12,
            "checkpoint_step": 4,
            "killed_at_step": 6,
            "params_identical": True,
            "losses_identical": True,
            "max_param_diff": 0.0,
            "max_loss_diff": 0.0,
            "first_divergent_step": None,
            "reason": "",
            "deterministic": True,
        },
        {
            "method": "torch-rank0",
            "model": "resnet18:w=0.5",
            "ranks": 2,
            "steps": 12,
            "checkpoint_step": 4,
            "killed_at_step": 5,
            "params_identical": False,
            "losses_identical": False,
            "max_param_diff": 0.01,
            "max_loss_diff": 0.2,
            "first_divergent_step": 5,
            "reason": METHODS["torch-rank0"].info.resume_note,
            "deterministic": False,
        },
    ]
    return {
        "schema": SCHEMA,
        "created": "2026-01-01T00:00:00+00:00",
        "host": {"hostname": "test", "cpus": 2, "device": "cpu", "python": "3.11", "torch": "2"},
        "config": get_preset("demo").to_dict(),
        "methods": {m: METHODS[m].info.to_dict() for m in METHODS},
        "skipped": [{"method": "dcp", "ranks": 4, "reason": "not here"}],
        "records": records,
        "determinism": checks,
        "errors": [],
    }

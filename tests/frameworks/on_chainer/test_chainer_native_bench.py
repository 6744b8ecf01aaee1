"""Smoke run of benchmarks/bench_frameworks.py with Chainer's native savers beside snapstate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("chainer") is None, reason="needs chainer: make test-frameworks"
)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import bench_frameworks  # noqa: E402


def test_every_method_writes_the_state(tmp_path: Path) -> None:
    rows = bench_frameworks.main(["--mib", "1", "--repeats", "1", "--dir", str(tmp_path)])
    by_name = {r["method"]: r for r in rows}
    assert {"chainer save_npz", "snapstate save"} <= set(by_name)
    state_bytes, _ = bench_frameworks.chainer_methods(1)
    for name in (
        "chainer save_npz (compression=False)",
        "snapstate save",
        "snapstate async_save + wait",
    ):
        # model and optimizer are stored uncompressed: at least the state's bytes
        assert by_name[name]["bytes"] >= state_bytes, name
    assert all(r["seconds"] > 0 for r in rows)

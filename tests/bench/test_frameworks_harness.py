"""The harness across frameworks: environments, launchers, grouping, and the bytes-vs-ranks table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from snapstate.bench import frameworks, launch
from snapstate.bench.report import bytes_vs_ranks
from snapstate.bench.runner import by_framework

from .synthetic import document


def test_torch_runs_in_this_interpreter() -> None:
    assert frameworks.python_for("torch") == sys.executable
    assert frameworks.unavailable("torch") is None


def test_a_missing_environment_names_the_make_target(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SNAPSTATE_TF_PYTHON", str(tmp_path / "nope" / "python"))
    reason = frameworks.unavailable("tensorflow")
    assert reason is not None and "make venv-tf" in reason and "SNAPSTATE_TF_PYTHON" in reason


def test_an_explicit_interpreter_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPSTATE_CHAINER_PYTHON", sys.executable)
    assert frameworks.python_for("chainer") == sys.executable


def test_unknown_framework_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown framework 'jax'"):
        frameworks.get_framework("jax")


def test_tf_config_lists_every_worker_and_this_task() -> None:
    cfg = json.loads(launch.tf_config(1, [4001, 4002]))
    assert cfg["cluster"]["worker"] == ["127.0.0.1:4001", "127.0.0.1:4002"]
    assert cfg["task"] == {"type": "worker", "index": 1}


def test_methods_are_grouped_by_framework_in_order() -> None:
    groups = by_framework(["snapstate", "torch-rank0", "dcp"])
    assert groups == {"torch": ["snapstate", "torch-rank0", "dcp"]}


def test_bytes_vs_ranks_shows_a_copy_per_rank() -> None:
    text = bytes_vs_ranks(document(("torch-allranks", "snapstate-async")))
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if "resnet18" in line}
    assert "4.00× (1→4 ranks)" in rows["torch-allranks"]
    assert "1.00× (1→4 ranks)" in rows["snapstate-async"]


def test_bytes_vs_ranks_needs_two_world_sizes() -> None:
    doc = document(("snapstate-async",))
    doc["records"] = [r for r in doc["records"] if r["ranks"] == 2]
    assert bytes_vs_ranks(doc) == ""


def test_ports_for_one_launch_are_distinct() -> None:
    ports = launch.free_ports(16)
    assert len(set(ports)) == 16


def test_a_tf_port_race_is_retried_and_other_failures_are_not() -> None:
    calls: list[int] = []

    def flaky() -> None:
        calls.append(1)
        if len(calls) < 2:
            raise launch.WorkerError(f"rank 1 failed: UnknownError: {launch.PORT_RACE}")

    launch.retry_port_race(flaky)
    assert len(calls) == 2

    def broken() -> None:
        calls.append(1)
        raise launch.WorkerError("rank 0 failed: ValueError")

    calls.clear()
    with pytest.raises(launch.WorkerError, match="ValueError"):
        launch.retry_port_race(broken)
    assert len(calls) == 1

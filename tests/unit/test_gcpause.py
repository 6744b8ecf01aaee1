"""The collector is off while a save or load runs on the caller's thread, and back on after."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from snapstate.engine.gcpause import paused


class Probe:
    """A Stateful that records whether the collector was on when snapstate called it."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(gc.isenabled())
        return {"w": torch.arange(8.0)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen.append(gc.isenabled())


@pytest.fixture(autouse=True)
def _collector_on() -> Any:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_nests_and_restores() -> None:
    with paused():
        assert not gc.isenabled()
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer caller is still inside
    assert gc.isenabled()


def test_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    with paused():
        pass
    assert not gc.isenabled()


def test_last_thread_out_turns_it_back_on() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    with paused():
        pass
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_restored_after_an_error() -> None:
    with pytest.raises(RuntimeError), paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


@pytest.mark.parametrize("mode", ["save", "async"])
def test_save_and_load_run_without_the_collector(tmp_path: Path, mode: str) -> None:
    probe = Probe()
    path = str(tmp_path / "ckpt")
    if mode == "async":
        ss.async_save({"p": probe}, path).wait()
    else:
        ss.save({"p": probe}, path)
    assert gc.isenabled()
    saved = len(probe.seen)
    ss.load({"p": probe}, path)
    assert gc.isenabled()
    assert saved >= 1 and len(probe.seen) > saved  # the save's calls, then the load's
    assert not any(probe.seen)


def test_collector_back_on_after_a_failed_load(tmp_path: Path) -> None:
    with pytest.raises(ss.CheckpointError):
        ss.load({"w": torch.zeros(2)}, str(tmp_path / "missing"))
    assert gc.isenabled()

"""One save in flight, with one owner (engine/inflight.py's SaveSlot): a new save waits for
the previous one, in ss.async_save and in the manager alike, and an error is reported once."""

from __future__ import annotations

import ast
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import snapstate as ss
from snapstate.engine.handle import SaveHandle, SaveResult
from snapstate.engine.inflight import SaveSlot

from .test_async import Gate
from .test_async import _no_save_left_in_flight as _no_save_left_in_flight  # autouse

SRC = Path(ss.__file__).resolve().parent


def result(step: int) -> SaveResult:
    return SaveResult("p", step, 0, 1, 0, [], 0.0, 0.0, 0.0, 0.0)


def gated_handle(gate: threading.Event, outcome: Callable[[], SaveResult]) -> SaveHandle:
    def run() -> SaveResult:
        assert gate.wait(30), "gate never opened"
        return outcome()

    return SaveHandle(run=run)


def fail() -> SaveResult:
    raise OSError("disk gone")


def test_a_slot_begins_the_next_save_only_once_the_previous_one_ended() -> None:
    slot, gate, begun = SaveSlot(), threading.Event(), threading.Event()
    first = slot.start(lambda: gated_handle(gate, lambda: result(1)))

    def begin_second() -> SaveHandle:
        begun.set()
        return SaveHandle(result=result(2))

    worker = threading.Thread(target=slot.start, args=(begin_second,))
    worker.start()
    assert not begun.wait(0.3), "the second save began while the first was in flight"
    gate.set()
    worker.join(30)
    assert begun.is_set() and first.done()
    assert slot.settle() == result(2) and slot.settle() is None


def test_an_error_nobody_saw_is_raised_once_by_the_next_start() -> None:
    slot, gate = SaveSlot(), threading.Event()
    slot.start(lambda: gated_handle(gate, fail))
    gate.set()
    begun = threading.Event()

    def begin_second() -> SaveHandle:
        begun.set()
        return SaveHandle(result=result(2))

    with pytest.raises(OSError, match="disk gone"):
        slot.start(begin_second)
    assert not begun.is_set(), "the next save began although the previous one's error was raised"
    slot.start(lambda: SaveHandle(result=result(3)))  # reported once: this one begins
    assert slot.settle() == result(3)


def test_an_error_seen_on_wait_is_not_raised_again() -> None:
    slot, gate = SaveSlot(), threading.Event()
    handle = slot.start(lambda: gated_handle(gate, fail))
    gate.set()
    with pytest.raises(OSError):
        handle.wait()
    assert slot.settle() is None


@pytest.mark.parametrize("second", ["api", "manager"])
def test_a_second_async_save_waits_for_a_managers_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    gate = Gate(monkeypatch)
    mgr = ss.CheckpointManager(tmp_path / "run", async_save=True)
    first = mgr.save(1, {"x": torch.ones(1000)})
    assert gate.blocked.wait(10)
    finished = threading.Event()

    def save_again() -> None:
        if second == "manager":
            mgr.save(2, {"x": torch.zeros(1000)}).wait()
        else:  # the process's slot holds the manager's save too
            ss.async_save({"y": torch.zeros(1000)}, tmp_path / "other").wait()
        finished.set()

    worker = threading.Thread(target=save_again)
    worker.start()
    assert not finished.wait(0.3) and not first.done(), (
        "a second save started while one was in flight"
    )
    gate.open()
    worker.join(30)
    assert finished.is_set() and first.done()
    mgr.close()
    assert mgr.steps() == ([1, 2] if second == "manager" else [1])


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_a_managers_save_is_waited_on_the_same_way_in_both_modes(
    tmp_path: Path, async_save: bool
) -> None:
    with ss.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        outcome = mgr.save(7, {"x": torch.ones(3)})
        assert isinstance(outcome, ss.SaveHandle if async_save else ss.SaveResult)
        saved = outcome.wait()
        assert outcome.done() and isinstance(saved, ss.SaveResult)
        assert saved.step == 7 and saved.path.endswith("step-000000007")
        assert (mgr.wait() is saved) if async_save else (mgr.wait() is None and saved is outcome)


def _modules_using(name: str) -> list[str]:
    """Source modules that import ``name`` or read an attribute of that name."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            imported = isinstance(node, ast.Import) and any(a.name == name for a in node.names)
            if imported or (isinstance(node, ast.Attribute) and node.attr == name):
                found.append(path.relative_to(SRC).as_posix())
                break
    return found


def test_the_in_flight_rule_has_one_owner() -> None:
    assert _modules_using("atexit") == ["engine/inflight.py"]
    assert sorted(_modules_using("observed")) == ["engine/handle.py", "engine/inflight.py"]

"""CheckpointManager on every backend: steps, retention, restore, leftovers and the lock."""

from __future__ import annotations

import json
import os
import socket

import pytest

import snapstate as ss
from snapstate.format.manifest import MANIFEST
from snapstate.lock import LOCK_FILE
from support.procs import dead_pid
from support.states import assert_same_state, training_state

from .conftest import Backend


def test_save_restore_retention_and_steps(backend: Backend) -> None:
    states = {step: training_state(seed=step) for step in (1, 2, 3, 4)}
    with ss.CheckpointManager(backend.target("run"), keep_last=2, async_save=True) as mgr:
        assert mgr.restore(training_state(seed=9)) is None
        for step, state in states.items():
            mgr.save(step, state)
        mgr.wait()
        assert mgr.steps() == [3, 4] and mgr.latest_step() == 4
        restored = training_state(seed=9)
        assert mgr.restore(restored) == 4
        assert_same_state(states[4], restored)
        assert mgr.restore(restored, step=3) == 3
        assert_same_state(states[3], restored)
    names = backend.storage("run").listdir()
    assert names == ["step-000000003", "step-000000004"]  # deleted steps are gone, lock released


def test_blocking_manager_and_resume_in_a_new_manager(backend: Backend) -> None:
    state = training_state(seed=5)
    with ss.CheckpointManager(
        backend.target("run"), keep_last=None, keep_every=None, async_save=False
    ) as mgr:
        for step in (10, 20):
            assert isinstance(mgr.save(step, state), ss.SaveResult)
    with ss.CheckpointManager(backend.target("run")) as mgr:
        assert mgr.steps() == [10, 20]
        restored = training_state(seed=6)
        assert mgr.restore(restored) == 20
        assert_same_state(state, restored)


def test_uncommitted_step_is_skipped_and_cleaned(backend: Backend) -> None:
    with ss.CheckpointManager(backend.target("run"), async_save=False) as mgr:
        mgr.save(1, training_state(seed=1))
        mgr.save(2, training_state(seed=2))
    backend.storage("run").remove(f"step-000000002/{MANIFEST}")  # as if it crashed before commit
    with ss.CheckpointManager(backend.target("run")) as mgr:
        assert mgr.steps() == [1]
        restored = training_state(seed=9)
        assert mgr.restore(restored) == 1
        assert_same_state(training_state(seed=1), restored)
    assert backend.storage("run").listdir() == ["step-000000001"]


def test_corrupt_latest_falls_back_to_the_previous_step(backend: Backend) -> None:
    with ss.CheckpointManager(backend.target("run"), async_save=False) as mgr:
        mgr.save(1, training_state(seed=1))
        mgr.save(2, training_state(seed=2))
    step2 = backend.storage("run").child("step-000000002")
    chunk = ss.inspect(step2).tensors["model/0.weight"].chunks[0]
    data = bytearray(step2.read_bytes(chunk.file))
    data[chunk.start] ^= 1
    step2.write_atomic(chunk.file, bytes(data))
    with ss.CheckpointManager(backend.target("run")) as mgr:
        restored = training_state(seed=9)
        assert mgr.restore(restored) == 1
        assert "checksum" in mgr.corrupt_steps[2]


def test_lock_keeps_a_second_manager_out(backend: Backend) -> None:
    with ss.CheckpointManager(backend.target("run")):
        holder = json.loads(backend.storage("run").read_bytes(LOCK_FILE))
        assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
    assert not backend.storage("run").exists(LOCK_FILE)  # released on close
    other = {"pid": os.getppid(), "host": socket.gethostname()}  # a live process on this host
    backend.storage("run").write_atomic(LOCK_FILE, json.dumps(other).encode())
    with pytest.raises(ss.CheckpointLockedError, match=str(os.getppid())):
        ss.CheckpointManager(backend.target("run"))


def test_stale_lock_of_a_dead_process_is_taken_over(backend: Backend) -> None:
    stale = {"pid": dead_pid(), "host": socket.gethostname()}
    backend.storage("run").write_atomic(LOCK_FILE, json.dumps(stale).encode())
    with ss.CheckpointManager(backend.target("run"), async_save=False) as mgr:
        mgr.save(1, training_state())
        assert json.loads(backend.storage("run").read_bytes(LOCK_FILE))["pid"] == os.getpid()
    assert not backend.storage("run").exists(LOCK_FILE)

"""A child process that checkpoints in a loop until it is killed, pausing at a named phase on request.

Run it as a script with one JSON run description (one process per run), or as a fork server
(``serve``): it imports torch once and forks one child per run, so dozens of SIGKILLs stay cheap.
The state it saves at each step is a pure function of the step (``make_state``), so the parent
can check what it reads back bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# Run as a script, this file finds the shared support where the tests do: tests/ on the path.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from support.bits import same_bits  # noqa: E402

STEP_RE = re.compile(r"step-(\d{9,})")
# key -> (shape, dtype); about 25 MiB in all, several dtypes, one non-contiguous tensor.
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w1": ((1024, 2048), torch.float32),
    "w2": ((2048, 1024), torch.float32),
    "emb": ((1024, 1024), torch.float16),
    "wt": ((1024, 512), torch.float32),  # saved as the transpose of a (512, 1024) tensor
    "m": ((1 << 20,), torch.float32),
    "ids": ((1 << 20,), torch.int8),
    "b": ((4096,), torch.bfloat16),
    "mask": ((1000,), torch.bool),
}


def _pattern(step: int, salt: int, n: int) -> torch.Tensor:
    """Pseudo-random int32s, distinct per step and tensor, cheap to regenerate."""
    gen = torch.Generator().manual_seed(step * 1000 + salt)
    return torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int32, generator=gen)


def _tensor(step: int, salt: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    x = _pattern(step, salt, math.prod(shape))
    if dtype is torch.bool:
        return (x & 1 == 0).view(shape)
    if dtype is torch.float32:  # arbitrary bit patterns, NaN payloads included: equality is bitwise
        return x.view(torch.float32).view(shape)
    if dtype in (torch.float16, torch.bfloat16):
        return x.to(torch.int16).view(dtype).view(shape)
    return x.to(dtype).view(shape)


def make_state(step: int) -> dict[str, Any]:
    """The state saved at ``step``."""
    model = {}
    for salt, (key, (shape, dtype)) in enumerate(SPECS.items()):
        if key == "wt":
            model[key] = _tensor(step, salt, shape[::-1], dtype).t()
        else:
            model[key] = _tensor(step, salt, shape, dtype)
    arr = _pattern(step, 99, 1 << 16).numpy().astype(np.float64) / 7.0
    return {
        "model": model,
        "np": arr,
        "meta": {"step": step, "note": f"step {step}", "lr": 1.0 / (step + 1)},
    }


FROZEN = ("w1", "w2", "emb", "wt")  # about 20 of the 25 MiB: what fine-tuning leaves alone


def incremental_state(step: int) -> dict[str, Any]:
    """The state an incremental run saves at ``step``: the FROZEN tensors never change, the
    others do every step, so each save references most of the previous step's bytes."""
    state, first = make_state(step), make_state(0)
    for key in FROZEN:
        state["model"][key] = first["model"][key]
    return state


def states_of(run: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    return incremental_state if run.get("incremental") else make_state


def blank_state() -> dict[str, Any]:
    """A state of the same structure, zero-filled: the target of a load."""
    model = {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in SPECS.items()}
    return {"model": model, "np": np.zeros(1 << 16), "meta": {"step": -1, "note": "", "lr": 0.0}}


def state_differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys whose bytes (or values) differ; empty when equal bit for bit."""
    bad = []
    for key in SPECS:
        a, b = got["model"][key], want["model"][key]
        if not same_bits(a, b):
            bad.append(f"model/{key}")
    if got["np"].tobytes() != want["np"].tobytes():
        bad.append("np")
    if got["meta"] != want["meta"]:
        bad.append("meta")
    return bad


# -- pausing at a phase --------------------------------------------------------------------------


class Pause:
    """Stops the process at the ``nth`` event of ``phase`` during the save of ``step``."""

    def __init__(self, phase: str, step: int, nth: int, signal_path: str) -> None:
        self.phase, self.step, self.nth, self.signal_path = phase, step, nth, signal_path
        self.count = 0
        self.lock = threading.Lock()

    def hit(self, phase: str, path: str | None) -> None:
        """Count an event; on the chosen one, tell the parent and wait to be killed."""
        if phase != self.phase or step_of(path) != self.step:
            return
        with self.lock:
            self.count += 1
            if self.count != self.nth:
                return
        tmp = self.signal_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"phase": phase, "step": self.step, "pid": os.getpid()}, f)
        os.replace(tmp, self.signal_path)
        parent = os.getppid()
        while os.getppid() == parent:  # an orphan (its test run died) must not sleep forever
            time.sleep(0.2)
        os._exit(1)


def step_of(path: str | None) -> int | None:
    found = STEP_RE.findall(path or "")
    return int(found[-1]) if found else None


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def install_pause(pause: Pause) -> None:
    """Monkeypatch the engine so that each phase reports itself to ``pause`` (see PHASES)."""
    import snapstate.api as api
    import snapstate.engine.save as save_mod
    from snapstate.engine.persist import RankWriter
    from snapstate.engine.staging import Stager
    from snapstate.storage.local import LocalFileWriter, LocalStorage

    staging = {"path": None}

    def start_save(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(state: Any, storage: Any, *a: Any, **k: Any) -> Any:
            staging["path"] = storage.root
            return orig(state, storage, *a, **k)

        return wrapped

    def stage(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, piece: torch.Tensor, *a: Any) -> Any:
            out = orig(self, piece, *a)
            pause.hit("stage", staging["path"])
            return out

        return wrapped

    def write(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, *a: Any) -> Any:
            out = orig(self, *a)
            pause.hit("write", self.storage.root)
            return out

        return wrapped

    def close(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, sync: bool = True) -> Any:
            pause.hit("fsync", self.full_path)
            return orig(self, sync)

        return wrapped

    def write_marker(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(storage: Any, *a: Any) -> Any:
            pause.hit("marker", storage.root)
            return orig(storage, *a)

        return wrapped

    def write_atomic(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, path: str, data: bytes) -> Any:
            if path == "manifest.json":
                pause.hit("commit", self.root)
            return orig(self, path, data)

        return wrapped

    def remove(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, path: str) -> Any:
            out = orig(self, path)
            if path.endswith("/manifest.json"):
                pause.hit("retention", f"{self.root}/{path}")
            if path.endswith(".safetensors"):  # retention deleting a step's files one by one
                pause.hit("retention_file", f"{self.root}/{path}")
            return out

        return wrapped

    _wrap(api, "start_save", start_save)
    _wrap(Stager, "stage", stage)
    _wrap(RankWriter, "_write", write)
    _wrap(RankWriter, "_write_decided", write)  # an incremental save writes here
    _wrap(LocalFileWriter, "close", close)
    _wrap(save_mod, "write_marker", write_marker)
    _wrap(LocalStorage, "write_atomic", write_atomic)
    _wrap(LocalStorage, "remove", remove)
    _install_os_pauses(pause)


def _install_os_pauses(pause: Pause) -> None:
    """The manifest's own temp file: torn mid-write, complete but not renamed, renamed."""
    real_write, real_replace = os.write, os.replace

    def write(fd: int, data: Any) -> int:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if (
            ".manifest.json." in name
            and pause.phase == "manifest_torn"
            and step_of(name) == pause.step
        ):
            real_write(fd, memoryview(data)[: len(data) // 2])
            pause.hit("manifest_torn", name)
        return real_write(fd, data)

    def replace(src: Any, dst: Any, **k: Any) -> None:
        is_manifest = str(dst).endswith("manifest.json")
        if is_manifest:
            pause.hit("manifest_rename", str(dst))
        real_replace(src, dst, **k)
        if is_manifest:
            pause.hit("renamed", str(dst))

    os.write = write  # type: ignore[assignment]
    os.replace = replace  # type: ignore[assignment]


# Phases in save order; only "renamed" (manifest in place) leaves the paused step committed.
PHASES = [
    "stage",
    "write",
    "fsync",
    "marker",
    "commit",
    "manifest_torn",
    "manifest_rename",
    "renamed",
    "retention",
]


# -- the save loop -------------------------------------------------------------------------------


def _log(run: dict[str, Any], line: str) -> None:
    with open(run["progress"], "a") as f:
        f.write(line + "\n")
        f.flush()


def _options(run: dict[str, Any]) -> Any:
    import snapstate as ss

    return ss.SaveOptions(
        piece_bytes=run.get("piece_bytes", 2 << 20),
        block_bytes=run.get("block_bytes", 1 << 20),
        plan=ss.PlanOptions(max_file_bytes=run.get("max_file_bytes", 2 << 30)),
    )


def run_loop(run: dict[str, Any]) -> None:
    """Save steps ``first .. first + steps - 1`` with ``run['mode']``; log each commit."""
    import snapstate as ss

    if run.get("pause"):
        install_pause(Pause(signal_path=run["signal"], **run["pause"]))
    mode, root = run["mode"], run["root"]
    if mode == "manager":
        _manager_loop(run)
        return
    pool = ss.HostBufferPool(budget_bytes=8 << 20, slab_bytes=4 << 20)
    _log(run, "ready")
    previous = None
    for step in range(run["first"], run["first"] + run["steps"]):
        path = os.path.join(root, f"step-{step:09d}")
        if mode == "save":
            ss.save(make_state(step), path, step=step, options=_options(run))
            _log(run, f"committed {step}")
        else:
            ss.async_save(make_state(step), path, step=step, options=_options(run), pool=pool)
            if previous is not None:  # async_save waited for it: it is committed
                _log(run, f"committed {previous}")
            previous = step
    if previous is not None:
        from snapstate.api import wait_for_pending

        wait_for_pending()
        _log(run, f"committed {previous}")


def _manager_loop(run: dict[str, Any]) -> None:
    import snapstate as ss

    states = states_of(run)
    with ss.CheckpointManager(
        run["root"],
        keep_last=run.get("keep_last"),
        async_save=run.get("async", True),
        options=_options(run),
        incremental=run.get("incremental", False),
    ) as mgr:
        state = blank_state()
        restored = mgr.restore(state)
        if restored is not None:
            bad = state_differences(state, states(restored))
            _log(run, f"restored {restored} {'ok' if not bad else 'BAD ' + ','.join(bad)}")
        _log(run, "ready")
        first = (
            run["first"]
            if run.get("first") is not None
            else (restored + 1 if restored is not None else 0)
        )
        previous = None
        for step in range(first, first + run["steps"]):
            mgr.save(step, states(step))
            if previous is not None:
                _log(run, f"committed {previous}")
            previous = step
        mgr.wait()
        if previous is not None:
            _log(run, f"committed {previous}")


# -- fork server ---------------------------------------------------------------------------------


def serve() -> None:
    """Read commands from stdin, one JSON per line: {"run": {...}} forks a child running it,
    {"kill": pid} SIGKILLs and reaps it, {"wait": pid} reaps it; each answers one JSON line."""
    _warm_up()
    for line in sys.stdin:
        cmd = json.loads(line)
        if "run" in cmd:
            pid = os.fork()
            if pid == 0:
                _child(cmd["run"])
            reply: dict[str, Any] = {"pid": pid}
        elif "kill" in cmd:
            try:
                os.kill(cmd["kill"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            reply = {"status": os.waitpid(cmd["kill"], 0)[1]}
        else:
            reply = {"status": os.waitpid(cmd["wait"], 0)[1]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def _warm_up() -> None:
    """Import what the first save imports lazily, once, before forking (no threads started)."""
    import snapstate.manager  # noqa: F401
    from snapstate.state.dtensor import is_dtensor

    is_dtensor(torch.empty(0))


def _child(run: dict[str, Any]) -> None:
    code = 0
    try:
        sys.stdin.close()
        run_loop(run)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the progress file
        _log(run, f"error {type(exc).__name__}: {exc}")
        code = 1
    finally:
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        run_loop(json.loads(sys.argv[1]))

"""Clocks, memory and storage probes shared by every method, so all are measured alike."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

CLEAR_REFS = "/proc/self/clear_refs"


def now() -> float:
    """The one clock of the harness (monotonic, high resolution)."""
    return time.perf_counter()


@contextlib.contextmanager
def timed(into: dict[str, list[float]], name: str) -> Iterator[None]:
    """Append the duration of the block to ``into[name]``; nestable."""
    start = now()
    try:
        yield
    finally:
        into.setdefault(name, []).append(now() - start)


def current_rss() -> int:
    return int(psutil.Process().memory_info().rss)


class PeakRSS:
    """Peak resident memory over a window: the kernel's high-water mark when it can be reset."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self._kernel = _can_reset_hwm()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        self.start_rss = current_rss()
        self._peak = self.start_rss
        if self._kernel:
            _reset_hwm()
        else:
            # Without a resettable high-water mark, sample often enough to catch staging copies.
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._peak = max(self._peak, _read_hwm() if self._kernel else 0, current_rss())

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, current_rss())

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def added(self) -> int:
        """Peak above the resident size at the start of the window."""
        return max(0, self._peak - self.start_rss)


def _can_reset_hwm() -> bool:
    try:
        _reset_hwm()
        return _read_hwm() > 0
    except OSError:
        return False


def _reset_hwm() -> None:
    # Writing 5 to clear_refs resets VmHWM (Linux >= 4.0), so each window has its own peak.
    with open(CLEAR_REFS, "w") as f:
        f.write("5")


def _read_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def write_fsync_seconds(path: Path, nbytes: int, chunk: int = 8 << 20) -> float:
    """Time to write ``nbytes`` and fsync them: the raw bandwidth a checkpoint could reach."""
    buf = os.urandom(min(chunk, max(nbytes, 1)))
    start = now()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(buf[: min(left, len(buf))])
        f.flush()
        os.fsync(f.fileno())
    elapsed = now() - start
    path.unlink()
    return elapsed


def walk_files(root: Path) -> list[tuple[str, int]]:
    """(relative path, size) of every file under ``root``, sorted."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            full = Path(dirpath) / name
            out.append((str(full.relative_to(root)), full.stat().st_size))
    return sorted(out)


def state_bytes(obj: object) -> int:
    """Bytes of every tensor reachable in nested dicts and lists (a state dict's payload)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0

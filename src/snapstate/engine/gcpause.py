"""The cyclic garbage collector paused while a save or load runs on the caller's thread.

A save's plan and a load's manifest allocate tens of thousands of short-lived containers
(JSON objects, item records); their count can trigger a full collection, which walks every
object of a training process (torch, its modules, the user's) and costs it 50-80 ms: more
than the whole load of a 34 MB state. Refcounting frees these containers anyway, so pausing
the collector for the call skips those collections rather than putting them off.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # callers inside paused(), on any thread
_was_enabled = False  # the collector's state when the first of them entered


@contextmanager
def paused() -> Iterator[None]:
    """Keep the collector off inside; the outermost exit restores what it was.

    Nests, and is safe across threads: the collector is re-enabled when the last caller
    leaves, and only if it was enabled when the first one came in.
    """
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()

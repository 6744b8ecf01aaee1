"""Keep a copy of the tensors a load overwrites, so that a failed load can put them back."""

from __future__ import annotations

import threading

import torch

from snapstate.state.dtensor import local_data
from snapstate.state.restore import ReadRequest
from snapstate.state.views import bits_view


class Rollback:
    """The bits of every existing target tensor as they were before the load.

    Chunks are read straight into their targets (no staging copy on the fast path) and only
    verified afterwards, so the old values must be kept aside until every read has passed.
    Freshly allocated tensors need no copy: nobody else holds them. Copies of accelerator
    tensors go to host memory, where space is rarely the limit. One clone per tensor: measured
    faster than copies into one fresh slab, whose pages all fault in on first touch.

    With ``ahead=True`` the copies are made on a thread of their own while the reads run, and a
    read into request ``i`` first waits for ``saved(i)``: on a cold page cache the copies are
    then made mostly while the reads wait for the disk.
    """

    def __init__(self, reads: list[ReadRequest], *, ahead: bool = False) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._reads = reads
        self._done = 0  # requests 0 .. _done-1 are saved (or need no copy)
        self._error: BaseException | None = None
        self._stop = False
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        if ahead:
            self._thread = threading.Thread(
                target=self._save_all, name="snapstate-rollback", daemon=True
            )
            self._thread.start()
        else:
            self._save_all()
            if self._error is not None:  # no read may start without every copy kept
                raise self._error

    def _save_all(self) -> None:
        try:
            for req in self._reads:
                copy = self._save(req)
                with self._ready:
                    if copy is not None:
                        self._saved.append(copy)
                    self._done += 1
                    self._ready.notify_all()
                    if self._stop:
                        return
        except BaseException as exc:  # raised to the reads waiting on it
            with self._ready:
                self._error = exc
                self._ready.notify_all()

    @staticmethod
    def _save(req: ReadRequest) -> tuple[torch.Tensor, torch.Tensor] | None:
        if req.fresh:
            return None
        data = bits_view(local_data(req.target).detach())
        if data.numel() == 0:
            return None
        return data, data.to("cpu", copy=True)

    def saved(self, index: int) -> None:
        """Wait until request ``index``'s old bits are kept aside (before it is written)."""
        with self._ready:
            self._ready.wait_for(lambda: self._done > index or self._error is not None)
            if self._done <= index and self._error is not None:
                raise self._error

    def _finish(self) -> None:
        if self._thread is None:
            return
        with self._ready:
            self._stop = True
        self._thread.join()
        self._thread = None

    def restore(self) -> None:
        """Put every saved tensor back, bit for bit (a target not yet saved was not written).

        Last saved first: where targets share memory (tied weights), a later copy may hold
        bytes an earlier read already wrote, and the first copy of each byte, the one taken
        before any write to it, must be the one that stays.
        """
        self._finish()
        with torch.no_grad():
            for data, copy in reversed(self._saved):
                data.copy_(copy.to(data.device))

    def discard(self) -> None:
        self._finish()
        self._saved.clear()

"""Keep a copy of the tensors a load overwrites, so that a failed load can put them back."""

from __future__ import annotations

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
    """

    def __init__(self, reads: list[ReadRequest]) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for req in reads:
            if req.fresh:
                continue
            data = bits_view(local_data(req.target).detach())
            if data.numel() == 0:
                continue
            self._saved.append((data, data.to("cpu", copy=True)))

    def restore(self) -> None:
        """Put every saved tensor back, bit for bit."""
        with torch.no_grad():
            for data, copy in self._saved:
                data.copy_(copy.to(data.device))

    def discard(self) -> None:
        self._saved.clear()

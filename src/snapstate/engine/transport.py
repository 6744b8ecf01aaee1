"""The load transport: read once and send across hosts, each rank its own reads on one host."""

from __future__ import annotations

from snapstate.collective.coordinator import Coordinator
from snapstate.collective.topology import host_count


def transport_ok(coord: Coordinator) -> bool:
    """Shared reads move bytes with CPU tensors; on other backends every rank reads for itself."""
    return getattr(coord, "backend", "gloo") == "gloo"


def use_read_once(coord: Coordinator, read_once: bool | None) -> bool:
    """``read_once=None`` (auto): read once and send only when the ranks span several hosts.

    On one host every rank reads the same page cache or local disk, and a local read is
    cheaper than a send over the process group's transport (gloo: about 3x slower measured on
    loopback), so each rank reads its own ranges. Across hosts storage is the shared
    bottleneck and each shared byte is read once. Every rank must pass the same value.
    """
    if coord.world_size == 1 or read_once is False or not transport_ok(coord):
        return False
    if read_once is True:
        return True
    return host_count(coord) > 1

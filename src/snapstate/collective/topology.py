"""Which load transport to use: read-once-and-send across hosts, own reads on one host."""

from __future__ import annotations

import socket
import weakref

from snapstate.collective.coordinator import Coordinator
from snapstate.collective.loadshare import transport_ok

# coordinator -> number of distinct hosts among its ranks (a group's hosts never change)
_hosts: weakref.WeakKeyDictionary[Coordinator, int] = weakref.WeakKeyDictionary()


def host_count(coord: Coordinator) -> int:
    """How many machines the ranks run on; one gather per coordinator, then cached."""
    if coord.world_size == 1:
        return 1
    count = _hosts.get(coord)
    if count is None:
        count = _hosts[coord] = len(set(coord.all_gather(socket.gethostname())))
    return count


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

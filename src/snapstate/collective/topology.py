"""How many hosts the ranks span (one gather per coordinator): a fact the load transport's
choice (``engine/transport.py``) takes."""

from __future__ import annotations

import socket
import weakref

from snapstate.collective.coordinator import Coordinator

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

"""How many hosts the ranks span (one gather per coordinator): a fact the load's route
(``engine/transport.py``) is chosen from."""

from __future__ import annotations

import socket
import weakref

from snapstate.collective.coordinator import Coordinator, gather_within

# coordinator -> number of distinct hosts among its ranks (a group's hosts never change)
_hosts: weakref.WeakKeyDictionary[Coordinator, int] = weakref.WeakKeyDictionary()


def host_count(coord: Coordinator, timeout: float | None = None) -> int:
    """How many machines the ranks run on; one gather per coordinator (bounded by
    ``timeout`` where given), then cached."""
    if coord.world_size == 1:
        return 1
    count = _hosts.get(coord)
    if count is None:
        hosts = gather_within(coord, socket.gethostname(), timeout)
        count = _hosts[coord] = len(set(hosts))
    return count

"""How a load moves its bytes and how it undoes a failure: decided once, as one value.

Three transports share one read plan: each rank reads its own bytes into its targets
(``OWN_READS``), local shards are mapped and every byte verified before any target is
written (``MAPPED``), or one rank reads the bytes several ranks need and sends them on
(``READ_ONCE``). The undo follows from the transport: a mapped load writes nothing before
its checks pass, any other keeps the targets' old values until every read has verified.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from snapstate.collective.coordinator import Coordinator


class Transport(enum.Enum):
    OWN_READS = "own reads"
    MAPPED = "mapped"
    READ_ONCE = "read once and send"


class Undo(enum.Enum):
    """What a failed load puts back, and when the copies it needs are made."""

    NOTHING = "nothing"  # verified before any target is written
    COPIES = "copies"  # the targets copied aside before the reads
    COPIES_AHEAD = "copies ahead"  # copied aside on a thread, while a cold disk reads


@dataclass(frozen=True)
class LoadRoute:
    """The decision a load follows to the end (``choose_route``)."""

    transport: Transport
    undo: Undo
    together: bool  # several ranks: every read's outcome is agreed before anyone goes on
    timeout: float | None  # bound on every wait for the other ranks; None: the group's own


@dataclass(frozen=True)
class LoadFacts:
    """What the choice depends on, each gathered or probed by the caller."""

    ranks: int
    hosts: int  # machines the ranks span (``collective/topology.py``)
    gloo: bool  # shared reads move bytes with CPU tensors: gloo only
    read_once: bool | None  # the caller's wish; None: auto
    compressed: bool  # compressed chunks are decoded on the own-reads path only
    mappable: bool  # the backend maps files and the bytes fit the page cache
    untrusted_stateful: bool  # a user's load_state_dict runs after the reads and may raise
    # whole chunks into host memory from shards not in the page cache: a probe of the files,
    # asked only where the answer matters (own reads)
    cold_whole_chunks: Callable[[], bool]


def read_once_wanted(ranks: int, hosts: int, gloo: bool, read_once: bool | None) -> bool:
    """``read_once=None`` (auto): read once and send only when the ranks span several hosts.

    On one host every rank reads the same page cache or local disk, and a local read is
    cheaper than a send over the process group's transport (gloo: about 3x slower measured on
    loopback), so each rank reads its own ranges. Across hosts storage is the shared
    bottleneck and each shared byte is read once. Every rank must pass the same value.
    """
    if ranks == 1 or read_once is False or not gloo:
        return False
    return read_once is True or hosts > 1


def choose_route(facts: LoadFacts, timeout: float | None = None) -> LoadRoute:
    """The transport and the undo, from facts every rank shares (so all choose alike).

    Mapped shards are verified before any target is written: nothing to put back, unless a
    user's load_state_dict may still raise. Cold pages too large to map are read in place with
    the old values copied aside while the disk reads (512 MiB cold: mapped 1.08-1.18x a raw
    read, in place with the copies made before the reads 1.28-2.4x).
    """
    shared = read_once_wanted(facts.ranks, facts.hosts, facts.gloo, facts.read_once)
    if shared and not facts.compressed:
        transport = Transport.READ_ONCE
    elif not facts.compressed and facts.mappable:
        transport = Transport.MAPPED
    else:
        transport = Transport.OWN_READS
    if transport is Transport.MAPPED:
        undo = Undo.COPIES if facts.untrusted_stateful else Undo.NOTHING
    elif transport is Transport.OWN_READS and facts.cold_whole_chunks():
        undo = Undo.COPIES_AHEAD
    else:
        undo = Undo.COPIES
    return LoadRoute(transport, undo, facts.ranks > 1, timeout)


def gloo_backend(coord: Coordinator) -> bool:
    """Whether the coordinator's bytes travel as CPU tensors (a one-process one has none)."""
    return getattr(coord, "backend", "gloo") == "gloo"

"""The default load transport: own reads on one host, read-once-and-send across hosts."""

from __future__ import annotations

from typing import Any

from snapstate.collective.topology import host_count
from snapstate.engine.transport import use_read_once


class _Ranks:
    """A coordinator whose gathers answer with the given hosts (one per rank)."""

    backend = "gloo"

    def __init__(self, hosts: list[str]) -> None:
        self.hosts = hosts
        self.world_size = len(hosts)
        self.rank = 0
        self.gathers = 0

    def all_gather(self, obj: Any) -> list[Any]:
        self.gathers += 1
        return list(self.hosts)


def test_one_host_reads_locally_by_default() -> None:
    coord = _Ranks(["a", "a"])
    assert use_read_once(coord, None) is False  # type: ignore[arg-type]
    assert use_read_once(coord, True) is True  # type: ignore[arg-type]


def test_several_hosts_read_once_by_default() -> None:
    coord = _Ranks(["a", "b", "a"])
    assert use_read_once(coord, None) is True  # type: ignore[arg-type]
    assert use_read_once(coord, False) is False  # type: ignore[arg-type]


def test_host_count_is_gathered_once_per_coordinator() -> None:
    coord = _Ranks(["a", "b"])
    assert host_count(coord) == 2 and host_count(coord) == 2  # type: ignore[arg-type]
    assert coord.gathers == 1


def test_other_backends_and_single_process_read_locally() -> None:
    nccl = _Ranks(["a", "b"])
    nccl.backend = "nccl"
    assert use_read_once(nccl, True) is False  # type: ignore[arg-type]
    assert use_read_once(_Ranks(["a"]), True) is False  # type: ignore[arg-type]

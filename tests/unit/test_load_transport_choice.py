"""The load's route: own reads on one host, read-once-and-send across hosts, mapped where the
backend maps, and the undo each transport needs; chosen once, as one value."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from snapstate.collective.topology import host_count
from snapstate.engine.transport import (
    LoadFacts,
    Transport,
    Undo,
    choose_route,
    read_once_wanted,
)


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


FACTS = LoadFacts(
    ranks=2,
    hosts=1,
    gloo=True,
    read_once=None,
    compressed=False,
    mappable=False,
    untrusted_stateful=False,
    cold_whole_chunks=lambda: False,
)


def test_one_host_reads_locally_by_default() -> None:
    assert read_once_wanted(2, 1, True, None) is False
    assert read_once_wanted(2, 1, True, True) is True


def test_several_hosts_read_once_by_default() -> None:
    assert read_once_wanted(3, 2, True, None) is True
    assert read_once_wanted(3, 2, True, False) is False


def test_host_count_is_gathered_once_per_coordinator() -> None:
    coord = _Ranks(["a", "b"])
    assert host_count(coord) == 2 and host_count(coord) == 2  # type: ignore[arg-type]
    assert coord.gathers == 1


def test_other_backends_and_single_process_read_locally() -> None:
    assert read_once_wanted(2, 2, False, True) is False
    assert read_once_wanted(1, 1, True, True) is False


@pytest.mark.parametrize(
    ("change", "transport", "undo"),
    [
        ({}, Transport.OWN_READS, Undo.COPIES),
        ({"cold_whole_chunks": lambda: True}, Transport.OWN_READS, Undo.COPIES_AHEAD),
        ({"mappable": True}, Transport.MAPPED, Undo.NOTHING),
        ({"mappable": True, "untrusted_stateful": True}, Transport.MAPPED, Undo.COPIES),
        ({"hosts": 2, "mappable": True}, Transport.READ_ONCE, Undo.COPIES),
        ({"hosts": 2, "compressed": True}, Transport.OWN_READS, Undo.COPIES),
        ({"mappable": True, "compressed": True}, Transport.OWN_READS, Undo.COPIES),
    ],
)
def test_the_route_follows_from_the_facts(
    change: dict[str, Any], transport: Transport, undo: Undo
) -> None:
    route = choose_route(replace(FACTS, **change), timeout=5.0)
    assert (route.transport, route.undo, route.together, route.timeout) == (
        transport,
        undo,
        True,
        5.0,
    )


def test_the_cache_is_probed_only_for_own_reads() -> None:
    probed: list[bool] = []

    def probe() -> bool:
        probed.append(True)
        return True

    choose_route(replace(FACTS, mappable=True, cold_whole_chunks=probe))
    assert probed == []

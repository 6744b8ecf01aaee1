"""Fixtures of the distributed tests: one rank server for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .launch import RankServer


@pytest.fixture(scope="session")
def ranks() -> Iterator[RankServer]:
    server = RankServer()
    yield server
    server.close()

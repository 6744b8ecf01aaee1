"""Backends under test: every conformance test runs once per backend through ``backend``.

``minimal`` and ``full`` are
third-party backends with none and with all of the optional capabilities (backends.py).
A backend supplies two things (as fsspec's abstract suite does): ``storage(name)``, a fresh
empty Storage, and ``target(name)``, what a user passes to the public API for the same place
(a directory path, a URL, or a Storage object). S3 is a real moto server on 127.0.0.1,
reached through s3fs exactly as users reach it: URLs plus fsspec's configuration.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from snapstate.storage.base import Storage
from snapstate.storage.fsspec import FsspecStorage
from snapstate.storage.local import LocalStorage
from snapstate.storage.tiers import TieredStorage

from .backends import FullStorage, MinimalStorage
from .s3 import BUCKET, S3Server, aws_test_credentials, s3_server  # noqa: F401 - fixtures

BACKENDS = ["local", "memory", "s3", "tiered", "minimal", "full"]


@dataclass
class Backend:
    name: str
    storage: Callable[[str], Storage]  # a fresh place, as a Storage
    target: Callable[[str], str | Storage]  # the same place, as the public API takes it


def _local(tmp: Path) -> Backend:
    return Backend("local", lambda n: LocalStorage(str(tmp / n)), lambda n: str(tmp / n))


def _outside(tmp: Path, name: str) -> Backend:
    """A third-party backend (backends.py): passed to the API as a Storage object."""
    make = MinimalStorage if name == "minimal" else FullStorage
    return Backend(name, lambda n: make(str(tmp / n)), lambda n: make(str(tmp / n)))


def _memory() -> Backend:
    run = uuid.uuid4().hex
    return Backend(
        "memory", lambda n: FsspecStorage(f"memory://{run}/{n}"), lambda n: f"memory://{run}/{n}"
    )


def _s3(server: S3Server) -> Backend:
    run = uuid.uuid4().hex
    return Backend(
        "s3",
        lambda n: server.storage(f"s3://{BUCKET}/{run}/{n}"),
        lambda n: f"s3://{BUCKET}/{run}/{n}",
    )


def _tiered(tmp: Path, server: S3Server) -> Backend:
    run = uuid.uuid4().hex

    def make(n: str) -> TieredStorage:
        return TieredStorage(
            LocalStorage(str(tmp / "fast" / n)), server.storage(f"s3://{BUCKET}/{run}/{n}")
        )

    return Backend("tiered", make, make)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    name = request.param
    if name == "local":
        return _local(tmp_path)
    if name == "memory":
        return _memory()
    if name in ("minimal", "full"):
        return _outside(tmp_path, name)
    server = request.getfixturevalue("s3_server")
    return _s3(server) if name == "s3" else _tiered(tmp_path, server)

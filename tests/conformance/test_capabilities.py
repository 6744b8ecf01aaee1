"""What each backend offers beyond the Protocol, as ``capabilities`` answers it."""

from __future__ import annotations

import dataclasses
import doctest
from pathlib import Path

import pytest

import snapstate.storage.base as base
from snapstate.storage.base import Capabilities, capabilities, vectored_writer
from snapstate.storage.local import LocalStorage
from support.storages import CountingStorage

from .backends import FullStorage, MinimalStorage


def offered(caps: Capabilities) -> set[str]:
    return {f.name for f in dataclasses.fields(caps) if getattr(caps, f.name) is not None}


ALL = {f.name for f in dataclasses.fields(Capabilities)}


def test_the_minimal_backend_offers_nothing_and_the_full_one_everything(tmp_path: Path) -> None:
    assert offered(capabilities(MinimalStorage(str(tmp_path)))) == set()
    assert offered(capabilities(FullStorage(str(tmp_path)))) == ALL
    assert offered(capabilities(LocalStorage(str(tmp_path)))) == ALL
    assert vectored_writer(MinimalStorage(str(tmp_path)).open_writer("a", 0)) is None
    assert vectored_writer(FullStorage(str(tmp_path)).open_writer("b", 0)) is not None


def test_a_wrapper_keeps_only_the_answers_not_the_fast_paths(tmp_path: Path) -> None:
    """Delegating wrappers must see every read: no mapping, no reader, no probe through them."""
    assert offered(capabilities(CountingStorage(LocalStorage(str(tmp_path))))) == {"link_check"}


def test_a_subclass_that_changes_a_base_method_loses_what_replaces_it(tmp_path: Path) -> None:
    class Counting(LocalStorage):
        def read_into(self, path: str, offset: int, out: memoryview) -> None:
            super().read_into(path, offset, out)

    assert offered(capabilities(Counting(str(tmp_path)))) == {
        "link_check",
        "regular_reads",
        "renames",
        "creates_new",
    }


def test_the_documented_third_party_backend_runs() -> None:
    result = doctest.testmod(base, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


def test_a_declaration_that_is_not_a_capabilities_value_is_refused(tmp_path: Path) -> None:
    class Wrong(MinimalStorage):
        def capabilities(self) -> object:
            return {"mappable": self}

    with pytest.raises(TypeError, match="Wrong.capabilities"):
        capabilities(Wrong(str(tmp_path)))

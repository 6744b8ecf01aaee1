"""The foreground gather: one collective for short objects, a second for the rest of long ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapstate.collective.torch_dist import INLINE_BYTES

from .launch import RankServer

pytestmark = pytest.mark.dist


def test_gather_returns_every_ranks_object_whatever_its_size(
    ranks: RankServer, tmp_path: Path
) -> None:
    results = ranks.run("collective.scen_gather:gather", 3, {}, tmp_path / "run").check()
    for r in results:
        assert all(r[k] for k in ("small", "at_inline", "one_long", "all_long")), r
        assert r["small_sizes"] == [
            ["ok", 0],
            ["ok", 1],
            ["ok", 2],
        ]  # tuples come back as JSON lists
        assert r["one_long_sizes"] == [3, 10 * INLINE_BYTES, 3]
        assert r["all_long_sizes"] == [2000, 2000, 2000]
    assert results[0] == results[1] == results[2]

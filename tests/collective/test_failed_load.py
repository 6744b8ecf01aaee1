"""A load that fails on one rank raises on every rank and leaves every rank's state as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from .launch import RankServer

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    ("read_once", "cold"),
    [(None, False), (True, False), (False, False), (None, True)],
    ids=["auto", "read-once", "own-reads", "auto-cold"],
)
def test_corrupt_bytes_of_one_rank_fail_every_rank(
    ranks: RankServer, tmp_path: Path, read_once: bool | None, cold: bool
) -> None:
    """Cold: the shards' pages are dropped first, so each rank reads in place, with copies
    of its targets kept aside, instead of the mapped load that checks before writing."""
    args = {"path": str(tmp_path / "ckpt"), "read_once": read_once, "cold": cold}
    results = ranks.run(
        "collective.scen_failed_load:corrupt_on_one_rank", 2, args, tmp_path / "job"
    ).check()
    assert results[1]["error"] == "CorruptCheckpointError"
    assert results[0]["error"] in ("CorruptCheckpointError", "CheckpointWorkerError")
    assert all(r["unchanged"] for r in results), results
    if cold:  # the files were cold for both ranks: both read in place
        assert all(r["kept_ahead"] for r in results), results


@pytest.mark.parametrize("read_once", [True, False], ids=["read-once", "own-reads"])
def test_resealed_dtype_fails_every_rank_before_any_read(
    ranks: RankServer, tmp_path: Path, read_once: bool
) -> None:
    """Issue 31 item 7: each rank holds the manifest to the shard headers when it plans."""
    args = {"path": str(tmp_path / "ckpt"), "read_once": read_once}
    results = ranks.run(
        "collective.scen_failed_load:retyped_manifest", 2, args, tmp_path / "job"
    ).check()
    for r in results:
        assert r["error"].startswith("CorruptCheckpointError"), r
        assert "manifest says int32, shard header says F32" in r["error"], r
        assert "key 'w'" in r["error"], r
    assert all(r["unchanged"] for r in results), results

"""``timeout=`` bounds every wait on other ranks, the foreground metadata gather included."""

from __future__ import annotations

from pathlib import Path

import pytest

from .launch import RankServer

pytestmark = pytest.mark.dist

TIMEOUT = 3.0


@pytest.mark.parametrize("mode", ["save", "async"])
def test_rank_stopped_before_save_times_out_the_others(
    ranks: RankServer, tmp_path: Path, mode: str
) -> None:
    work = tmp_path / "job"
    work.mkdir()
    args = {"path": str(tmp_path / "ckpt"), "timeout": TIMEOUT, "work": str(work), "mode": mode}
    job = ranks.run("collective.scen_timeouts:stopped_before_save", 3, args, work, timeout=90)
    assert job.codes[1] == -9 and not job.timed_out, job.describe()
    for r in (job.results[0], job.results[2]):
        assert r["timeout_error"], r
        # bounded by timeout= (with margin for a loaded machine), not the group's 120 s
        assert TIMEOUT - 0.5 <= r["seconds"] < TIMEOUT + 20, r
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


@pytest.mark.parametrize("read_once", [False, True], ids=["own-reads", "read-once"])
def test_rank_stopped_in_its_first_read_times_out_the_load_of_the_others(
    ranks: RankServer, tmp_path: Path, read_once: bool
) -> None:
    work = tmp_path / "job"
    work.mkdir()
    args = {
        "path": str(tmp_path / "ckpt"),
        "timeout": TIMEOUT,
        "work": str(work),
        "read_once": read_once,
    }
    job = ranks.run("collective.scen_timeouts:stopped_in_load", 3, args, work, timeout=90)
    assert job.codes[1] == -9 and not job.timed_out, job.describe()
    for r in (job.results[0], job.results[2]):
        assert r["timeout_error"], r
        assert TIMEOUT - 0.5 <= r["seconds"] < TIMEOUT + 20, r
        assert r["untouched"], r  # a load that gave up left the state as it was

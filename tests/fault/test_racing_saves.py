"""Issue 31 item 2: two processes saving one path at once, for real.

Without overwrite exactly one wins and the other gets CheckpointExistsError; with overwrite
the last commit wins; either way the committed checkpoint is one whole save that verifies.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import snapstate as ss
from support.procs import JsonLinesChild

from .racing_saver import state_of

CHILD = str(Path(__file__).with_name("racing_saver.py"))


def _saver(work: Path, who: int, rounds: int, overwrite: bool) -> JsonLinesChild:
    return JsonLinesChild(CHILD, str(work), str(who), str(rounds), "1" if overwrite else "0")


def _race(work: Path, rounds: int, overwrite: bool) -> list[list[str]]:
    savers = [_saver(work, who, rounds, overwrite) for who in (1, 2)]
    outcomes = []
    try:
        for r in range(rounds):
            for s in savers:
                assert s.line() == {"ready": r}
            (work / f"go-{r}").touch()
            outcomes.append([s.line()["outcome"] for s in savers])
    finally:
        for s in savers:
            s.close()
    return outcomes


def _whole_save_of(ckpt: Path) -> int:
    """Which saver's state the committed checkpoint holds, after checking it is all one save."""
    ss.verify(ckpt)
    target = {f"t{i}": torch.zeros(1 << 18) for i in range(8)} | {"who": 0}
    ss.load(target, ckpt)
    who = target["who"]
    want = state_of(who)
    assert all(torch.equal(target[k], want[k]) for k in want if k != "who"), "a mixed save"
    return int(who)


def _check(work: Path, outcomes: list[list[str]], overwrite: bool) -> None:
    for r, pair in enumerate(outcomes):
        if overwrite:
            assert pair == ["ok", "ok"], f"round {r}: {pair}"
        else:
            assert sorted(pair) == ["exists", "ok"], f"round {r}: exactly one wins, got {pair}"
        who = _whole_save_of(work / f"round-{r}")
        if not overwrite:
            assert pair[who - 1] == "ok", f"round {r}: the committed save is the winner's"


@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "overwrite"])
def test_two_processes_saving_one_path(tmp_path: Path, overwrite: bool) -> None:
    outcomes = _race(tmp_path, 6, overwrite)
    _check(tmp_path, outcomes, overwrite)


@pytest.mark.slow
def test_two_processes_saving_one_path_many_rounds(tmp_path: Path) -> None:
    outcomes = _race(tmp_path, 30, overwrite=False)
    _check(tmp_path, outcomes, overwrite=False)

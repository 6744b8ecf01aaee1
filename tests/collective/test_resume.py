"""Resume across kills: DDP training bit for bit, and the elastic data order on a new world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .launch import RankServer

pytestmark = pytest.mark.dist

STEPS, SAVE_AT, KILL_AT = 30, 15, 17  # 12 steps an epoch: the checkpoint is mid-epoch


def losses(path: Path) -> dict[int, str]:
    return dict(line.split() for line in path.read_text().splitlines())  # type: ignore[misc]


def test_ddp_killed_and_resumed_equals_uninterrupted(ranks: RankServer, tmp_path: Path) -> None:
    def job(name: str, **extra: object) -> list:
        out = tmp_path / name
        out.mkdir()
        args = {"root": str(tmp_path / f"ckpt-{name}"), "out": str(out), "steps": STEPS, **extra}
        return ranks.run("collective.scen_train:train", 2, args, out, timeout=120).results

    reference = job("reference")
    out = tmp_path / "killed"
    out.mkdir()
    root = tmp_path / "ckpt-killed"
    args = {
        "root": str(root),
        "out": str(out),
        "steps": STEPS,
        "save_at": SAVE_AT,
        "kill_at": KILL_AT,
    }
    killed = ranks.run("collective.scen_train:train", 2, args, out, timeout=120)
    assert killed.codes == [-9, -9], killed.describe()
    assert (root / f"step-{SAVE_AT:09d}" / "manifest.json").exists()
    resumed_out = tmp_path / "resumed"
    resumed_out.mkdir()
    again = {**args, "out": str(resumed_out), "resume": True, "kill_at": None}
    resumed = ranks.run("collective.scen_train:train", 2, again, resumed_out, timeout=120).check()
    for rank in (0, 1):
        want = losses(tmp_path / "reference" / f"losses-{rank}.txt")
        before = {s: v for s, v in losses(out / f"losses-{rank}.txt").items() if int(s) <= SAVE_AT}
        after = losses(resumed_out / f"losses-{rank}.txt")
        assert len(want) == STEPS and min(map(int, after)) == SAVE_AT + 1
        assert {**before, **after} == want  # every loss, bit for bit
        # parameters and optimizer state
        assert resumed[rank]["params"] == reference[rank]["params"]
        assert resumed[rank]["rng"] == reference[rank]["rng"]
    # negative control: the same resume without the RNG state diverges (dropout), so the check has teeth
    control_out = tmp_path / "control"
    control_out.mkdir()
    ranks.run(
        "collective.scen_train:train",
        2,
        {**again, "out": str(control_out), "skip": "rng"},
        control_out,
        timeout=120,
    ).check()
    want = losses(tmp_path / "reference" / "losses-0.txt")
    assert {**losses(control_out / "losses-0.txt")}.items() - want.items()


def test_elastic_sampler_2_ranks_killed_then_3_ranks(ranks: RankServer, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    first = ranks.run(
        "collective.scen_train:elastic",
        2,
        {"path": path, "out": str(tmp_path), "save_after": 5, "kill_after": 7},
        tmp_path / "two",
    )
    assert first.codes == [-9, -9], first.describe()
    covered = [i for r in (0, 1) for i in json.loads((tmp_path / f"seen-{r}.json").read_text())]
    assert len(covered) == 2 * 5 * 4
    second = ranks.run(
        "collective.scen_train:elastic",
        3,
        {"path": path, "out": str(tmp_path), "resume": True},
        tmp_path / "three",
    ).check()
    rest = [i for r in second for i in r["seen"]]
    assert sorted(covered + rest) == list(range(96))  # the epoch's samples, each exactly once
    assert [len(r["seen"]) for r in second] == [19, 19, 18]
    assert all(
        r["state"] == {"epoch": 1, "consumed": 0, "seed": 11, "size": 96, "shuffle": True}
        for r in second
    )

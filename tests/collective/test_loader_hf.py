"""HF-style DDP on 2 ranks with per-rank loader generators: saves without wrapping the loader,
and a SIGKILLed run resumed in new processes is bit for bit the uninterrupted one on both ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .launch import RankServer

pytestmark = pytest.mark.dist

TOTAL, KILL_AT = 18, 10  # 3 epochs of 6 steps; killed after step 10, checkpoint 8 is mid-epoch 2
BOUNDARY = 12  # killed right after checkpoint 12, the last step of epoch 2
SCEN = "collective.scen_loader_hf:train"


def losses(path: Path) -> dict[int, str]:
    return {int(s): v for s, v in (line.split() for line in path.read_text().splitlines())}


def job(ranks: RankServer, work: Path, name: str, **args: Any) -> tuple[Path, list[Any]]:
    out = work / name
    out.mkdir()
    args = {"root": str(work / f"ckpt-{args.pop('root', name)}"), "out": str(out), **args}
    result = ranks.run(SCEN, 2, args, out, timeout=150)
    if args.get("kill_at"):
        assert result.codes == [-9, -9], result.describe()
        return out, result.results
    return out, result.check()


def kill_and_resume(
    ranks: RankServer, work: Path, kill_at: int = KILL_AT, **case: Any
) -> tuple[Path, Path, Path, list, list]:
    ref, reference = job(ranks, work, "reference", **case)
    killed, _ = job(ranks, work, "killed", kill_at=kill_at, **case)
    resumed, results = job(ranks, work, "resumed", root="killed", resume=True, **case)
    return ref, killed, resumed, reference, results


CASES = [
    {"sampler": "distributed", "workers": 0},
    {"sampler": "distributed", "workers": 2},
    {"sampler": "elastic", "workers": 0},
    {"sampler": "elastic", "workers": 2},
    {"sampler": "distributed", "workers": 0, "kill_at": BOUNDARY},
    {"sampler": "elastic", "workers": 0, "kill_at": BOUNDARY},
]


def case_id(c: dict[str, Any]) -> str:
    return f"{c['sampler']}-workers{c['workers']}" + ("-boundary" if "kill_at" in c else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_per_rank_loader_saves_and_resumes_bitwise_on_both_ranks(
    case: dict[str, Any], ranks: RankServer, tmp_path: Path
) -> None:
    ref, killed, resumed, reference, results = kill_and_resume(ranks, tmp_path, **case)
    saved = case.get("kill_at", KILL_AT) // 4 * 4
    assert (tmp_path / "ckpt-killed" / f"step-{saved:09d}" / "manifest.json").exists()
    for rank in (0, 1):
        want = losses(ref / f"losses-{rank}.txt")
        assert sorted(want) == list(range(1, TOTAL + 1))
        before = {s: v for s, v in losses(killed / f"losses-{rank}.txt").items() if s <= saved}
        after = losses(resumed / f"losses-{rank}.txt")
        assert min(after) == saved + 1
        assert before | after == want  # every loss of both ranks, bit for bit
        assert results[rank] == reference[rank]  # parameters, AdamW state, learning rate
    # the ranks really iterate different data (per-rank shards and generators)
    assert losses(ref / "losses-0.txt") != losses(ref / "losses-1.txt")


@pytest.mark.parametrize("skip", ["rng", "loader"])
def test_negative_control_without_rng_or_loader_state_diverges(
    skip: str, ranks: RankServer, tmp_path: Path
) -> None:
    case = {"sampler": "distributed", "workers": 0}
    ref, _ = job(ranks, tmp_path, "reference", **case)
    job(ranks, tmp_path, "killed", kill_at=KILL_AT, **case)
    control, _ = job(
        ranks, tmp_path, "control", root="killed", resume=True, skip=skip, no_save=True, **case
    )
    for rank in (0, 1):
        want, got = losses(ref / f"losses-{rank}.txt"), losses(control / f"losses-{rank}.txt")
        differ = [s for s in got if s in want and got[s] != want[s]]
        assert len(differ) >= 5, f"rank {rank}: a resume without {skip} must diverge"


@pytest.mark.parametrize("sampler", ["distributed", "elastic"])
def test_other_world_size_names_the_loader_key_and_skipping_it_loads_the_rest(
    sampler: str, ranks: RankServer, tmp_path: Path
) -> None:
    job(ranks, tmp_path, "saved", sampler=sampler, workers=0)  # checkpoints 4..18 on 2 ranks
    out = tmp_path / "one-rank"
    args = {"root": str(tmp_path / "ckpt-saved"), "out": str(out), "sampler": sampler}
    [result] = ranks.run("collective.scen_loader_hf:load_other_world", 1, args, out).check()
    assert "\n  loader: per-rank state saved on 2 ranks, loading on 1" in result["refused"]
    assert "\n  rng: " in result["refused"] and "rank_local='skip'" in result["refused"]
    assert result["step"] == 16  # the rest of the state did load (the last checkpoint)
    if sampler == "elastic":  # step 16 is batch 4 of epoch 2 (0-based): 4 * 4 * 2 samples in
        assert (result["epoch"], result["position"]) == (2, 32)


def test_shuffled_per_rank_loader_is_rank_local_and_a_per_rank_tensor_is_refused_with_the_fix(
    ranks: RankServer, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = {"root": str(tmp_path)}
    results = ranks.run("collective.scen_loader_hf:shuffled_per_rank", 2, args, out).check()
    for r in results:
        assert r["per_rank"] == {"0": ["loader", "rng"], "1": ["loader", "rng"]}
        assert "'seen'" in r["refused"] and "loader" not in r["refused"].split("Likely cause")[0]
        assert "ss.RankLocal(" in r["refused"] and "verify_replicas='off'" in r["refused"]
        assert "unchecked_replicas=('<key>',)" in r["refused"]
        assert r["unchecked_saved"] == 0  # with the check skipped for 'seen', rank 0's copy

"""The Hugging Face Trainer with snapstate: a SIGKILLed and resumed train() is bitwise the
uninterrupted one.

Every run is a real Trainer in processes forked by ``hf_train.py`` (transformers is imported
once per module), one per rank; the kills are real SIGKILLs, the DDP runs two real processes on
gloo. 64 samples, batches of 8 per rank: 8 steps an epoch on one process, 4 on two, 3 epochs,
a checkpoint every 3 steps unless a test says otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import snapstate as ss
from support.bits import assert_tree_equal
from support.integrations import needs, recipe, trainer_server
from support.procs import LineServer

pytestmark = needs("transformers")

SERVER = str(Path(__file__).with_name("hf_train.py"))
DOC = Path(__file__).parents[2] / "docs" / "integrations.md"
KILLED = -9
CHECKPOINT_FILES = ["manifest.json", "shards", "trainer_state.json"]  # no .pth, no pickle
DDP = {"world": 2, "args": {"save_total_limit": 2}}  # 4 steps an epoch, 12 in all


@pytest.fixture(scope="module")
def server() -> Iterator[LineServer]:
    yield from trainer_server(SERVER)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_trainer")


def train(server: LineServer, out: Path, expect: int = 0, **config: Any) -> Path:
    """One run of hf_train.py; every rank must exit with ``expect`` (-9: killed)."""
    job = {"out": str(out), "mode": "snapstate", **config}
    codes = server.ask(job, timeout=150)["codes"]
    if any(code != expect for code in codes):
        logs = [p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("rank*.log"))]
        raise AssertionError(f"exit codes {codes}, expected {expect}:\n" + "\n---\n".join(logs))
    return out


def resume(server: LineServer, killed: Path, out: Path, **config: Any) -> Path:
    """Resume the run ``killed`` left behind: its output_dir, with ``resume`` (True or a path)."""
    args = {"output_dir": str(killed / "run"), **config.pop("args", {})}
    return train(server, out, args=args, **config)


def losses(out: Path, rank: int = 0) -> list[tuple[int, str]]:
    lines = (out / f"losses-{rank}.txt").read_text().split()
    return [(int(step), loss) for step, loss in zip(lines[::2], lines[1::2])]


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir())


@pytest.fixture(scope="module")
def reference(server: LineServer, work: Path) -> Path:
    """The uninterrupted run: the plain Trainer, saving nothing."""
    return train(server, work / "reference", mode="plain")


def assert_resumed_bitwise(
    reference: Path, killed: Path, resumed: Path, start: int, world: int = 1
) -> None:
    """On every rank, the killed run's losses, then the resumed run's, are the reference's; so
    is each rank's end state (parameters and optimizer)."""
    for rank in range(world):
        expected = losses(reference, rank)
        before, after = losses(killed, rank), losses(resumed, rank)
        assert len(expected) == 24 // world
        assert before == expected[: len(before)], f"rank {rank}: the killed run already differs"
        # start == len(before): a save in flight committed before the kill, at the last step
        assert after[0][0] == start + 1 and start <= len(before), f"resumed after {after[0][0]}"
        assert after == expected[start:], f"rank {rank}: the resumed losses differ"
        want, got = (ss.read_state(out / f"final-{rank}") for out in (reference, resumed))
        assert_tree_equal(want, got)


def test_killed_mid_epoch_and_resumed_from_the_last_is_bitwise(
    server: LineServer, work: Path, reference: Path
) -> None:
    killed = train(server, work / "mid", KILLED, kill_at=5)  # saved at step 3
    run = killed / "run"
    assert checkpoints(run) == ["checkpoint-3"]
    assert sorted(os.listdir(run / "checkpoint-3")) == CHECKPOINT_FILES
    assert ss.verify(run / "checkpoint-3").ok
    resumed = resume(server, killed, work / "mid-resumed", resume=True)
    assert_resumed_bitwise(reference, killed, resumed, start=3)


def test_blocking_saves_resume_bitwise_too(server: LineServer, work: Path, reference: Path) -> None:
    killed = train(server, work / "blocking", KILLED, kill_at=5, blocking=True)
    resumed = resume(server, killed, work / "blocking-resumed", resume=True, blocking=True)
    assert_resumed_bitwise(reference, killed, resumed, start=3)


def test_killed_after_an_epoch_and_resumed_from_a_path_is_bitwise(
    server: LineServer, work: Path, reference: Path
) -> None:
    every_epoch = {"save_steps": 8}
    killed = train(server, work / "epoch", KILLED, kill_at=11, args=every_epoch)
    path = killed / "run" / "checkpoint-8"
    resumed = resume(server, killed, work / "epoch-resumed", resume=str(path), args=every_epoch)
    assert_resumed_bitwise(reference, killed, resumed, start=8)


def test_killed_while_a_save_is_in_flight_resumes_bitwise_from_a_committed_one(
    server: LineServer, work: Path, reference: Path
) -> None:
    killed = train(server, work / "flight", KILLED, kill_on_save=6)
    run = killed / "run"
    named = [n for n in checkpoints(run) if not n.startswith(".")]
    assert named in (["checkpoint-3"], ["checkpoint-3", "checkpoint-6"])
    for name in named:  # checkpoint-6 is there only once committed
        assert ss.verify(run / name).ok and (run / name / "trainer_state.json").is_file()
    resumed = resume(server, killed, work / "flight-resumed", resume=True)
    assert_resumed_bitwise(reference, killed, resumed, start=int(named[-1].split("-")[1]))


def test_negative_control_without_the_rng_the_resume_is_not_bitwise(
    server: LineServer, work: Path, reference: Path
) -> None:
    # The mid-epoch flow, resumed with everything but the RNG: dropout's masks part from the
    # uninterrupted run's, which the bitwise check must see.
    killed = train(server, work / "control", KILLED, mode="no-rng", kill_at=5)
    resumed = resume(server, killed, work / "control-resumed", mode="no-rng", resume=True)
    assert losses(killed) == losses(reference)[:5]
    assert losses(resumed)[0][0] == 4
    assert losses(resumed) != losses(reference)[3:]
    with pytest.raises(AssertionError):
        assert_resumed_bitwise(reference, killed, resumed, start=3)


@pytest.fixture(scope="module")
def reference_ddp(server: LineServer, work: Path) -> Path:
    return train(server, work / "reference-ddp", mode="plain", world=2)


@pytest.fixture(scope="module")
def killed_ddp(server: LineServer, work: Path) -> Path:
    """Saved at steps 3, 6 and 9 (one step into the last epoch), the last two kept; both ranks
    stopped at 10, then SIGKILLed together."""
    return train(server, work / "ddp", KILLED, kill_at=10, **DDP)


def resume_ddp(server: LineServer, killed: Path, out: Path, **config: Any) -> Path:
    """Resume on 2 ranks from a copy of ``killed``'s output_dir: each resume starts from the
    checkpoints the kill left."""
    shutil.copytree(killed / "run", out / "run")
    return train(server, out, resume=True, **DDP, **config)


def test_ddp_every_rank_writes_each_checkpoint_with_its_own_rng(killed_ddp: Path) -> None:
    run = killed_ddp / "run"
    assert checkpoints(run) == ["checkpoint-6", "checkpoint-9"]  # rotated, no hidden leftover
    assert sorted(os.listdir(run / "checkpoint-9")) == CHECKPOINT_FILES
    manifest = ss.inspect(run / "checkpoint-9")
    assert manifest.world_size == 2 and ss.verify(run / "checkpoint-9").ok
    shared = {
        key: [manifest.files[c.file].rank for c in t.chunks] for key, t in manifest.tensors.items()
    }
    assert {key.split("/")[0] for key in shared} == {"model", "optimizer"}
    assert all(len(ranks) == 1 for ranks in shared.values()), shared  # replicated: once
    assert {ranks[0] for ranks in shared.values()} == {0, 1}, shared  # each rank a share
    assert sorted(manifest.rank_local) == [0, 1]
    rngs = []
    for rank in range(2):
        own = {
            record.rank
            for t in manifest.rank_local[rank].tensors.values()
            for c in t.chunks
            for record in [manifest.files[c.file]]
        }
        assert own == {rank}, f"rank {rank}'s state written by {own}"
        rng = ss.read_state(run / "checkpoint-9", ["rng"], rank=rank)["rng"]["torch"]
        at_save = (killed_ddp / f"rng-{rank}-9.bin").read_bytes()
        assert rng.numpy().tobytes() == at_save, f"rank {rank}: not its RNG of the save"
        rngs.append(at_save)
    assert rngs[0] != rngs[1]  # each rank's own: the check above tells them apart


def test_ddp_killed_on_every_rank_and_resumed_is_bitwise_on_every_rank(
    server: LineServer, work: Path, reference_ddp: Path, killed_ddp: Path
) -> None:
    resumed = resume_ddp(server, killed_ddp, work / "ddp-resumed")
    assert_resumed_bitwise(reference_ddp, killed_ddp, resumed, start=9, world=2)
    run = resumed / "run"
    assert checkpoints(run) == ["checkpoint-12", "checkpoint-9"]  # save_total_limit=2 again
    assert all(ss.verify(run / name).ok for name in checkpoints(run))


def test_ddp_negative_control_every_rank_resumed_with_rank_0s_rng_is_not_bitwise(
    server: LineServer, work: Path, reference_ddp: Path, killed_ddp: Path
) -> None:
    # The same resume with one RNG for the job, rank 0's: rank 1's dropout masks part from the
    # uninterrupted run's at once, and through the averaged gradients so do rank 0's losses.
    resumed = resume_ddp(server, killed_ddp, work / "ddp-control", mode="rank0-rng")
    first = [losses(resumed, rank)[0] for rank in range(2)]
    assert first[0] == losses(reference_ddp, 0)[9]  # rank 0's own RNG: its step 10 as it was
    assert first[1][0] == 10 and first[1] != losses(reference_ddp, 1)[9]
    with pytest.raises(AssertionError):
        assert_resumed_bitwise(reference_ddp, killed_ddp, resumed, start=9, world=2)


def test_ddp_killed_while_a_save_is_in_flight_resumes_bitwise_from_a_committed_one(
    server: LineServer, work: Path, reference_ddp: Path
) -> None:
    killed = train(server, work / "ddp-flight", KILLED, kill_on_save=9, **DDP)
    run = killed / "run"
    named = [n for n in checkpoints(run) if not n.startswith(".")]
    # checkpoint-9 uncommitted, or committed (and checkpoint-3 rotated away once it is)
    assert named in (
        ["checkpoint-3", "checkpoint-6"],
        ["checkpoint-3", "checkpoint-6", "checkpoint-9"],
        ["checkpoint-6", "checkpoint-9"],
    )
    for name in named:  # checkpoint-9 is there only once committed
        assert ss.verify(run / name).ok and (run / name / "trainer_state.json").is_file()
    resumed = resume_ddp(server, killed, work / "ddp-flight-resumed")
    start = int(named[-1].split("-")[1])
    assert_resumed_bitwise(reference_ddp, killed, resumed, start=start, world=2)


@pytest.mark.parametrize("saved_on, resumed_on", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_world_size_without_the_ranks_rngs(
    server: LineServer, work: Path, killed_ddp: Path, saved_on: int, resumed_on: int
) -> None:
    # A job resumed on fewer ranks (after a node failure) or more: model, optimizer and
    # scheduler load, the per-rank RNGs cannot serve the new ranks and are skipped with a
    # warning, as the Trainer skips its own files' (they failed the resume before).
    out = work / f"world-{saved_on}-to-{resumed_on}"
    if saved_on == 2:
        killed, at = killed_ddp, 9
    else:
        killed, at = train(server, work / "world-1", KILLED, kill_at=5), 3
    shutil.copytree(killed / "run", out / "run")
    resumed = train(server, out, resume=True, world=resumed_on)
    warning = f"holds the RNG states of world size {saved_on}, this run's is {resumed_on}"
    for rank in range(resumed_on):
        steps = [step for step, _ in losses(resumed, rank)]
        assert steps == list(range(at + 1, 24 // resumed_on + 1))
        assert warning in (resumed / f"rank{rank}.log").read_text()


def test_ddp_every_rank_sees_the_checkpoints_rank_0_renamed_into_place(
    server: LineServer, work: Path
) -> None:
    # Rank 0 renames each committed checkpoint 0.5 s late, the last one (the best: the lowest
    # eval loss) included. A rank that moved on at the commit would not find it at the end,
    # skip the load that rank 0 enters (a collective) and leave rank 0 hanging.
    best_at_end = {
        "eval_strategy": "steps",
        "eval_steps": 3,
        "load_best_model_at_end": True,
        "metric_for_best_model": "loss",
    }
    out = train(server, work / "ddp-slow", world=2, slow_publish=0.5, args=best_at_end, timeout=60)
    best = [json.loads((out / f"best-{rank}.json").read_text()) for rank in range(2)]
    assert best[0] == best[1] and best[0]["step"] == 12, best
    model = ss.read_state(best[0]["best"], ["model"])
    for rank in range(2):
        assert_tree_equal(ss.read_state(out / f"final-{rank}", ["model"]), model)


@pytest.mark.parametrize("world", [1, 2])
def test_save_total_limit_keeps_exactly_n_and_the_best_model_is_loaded_at_the_end(
    server: LineServer, work: Path, world: int
) -> None:
    best_at_end = {
        "save_total_limit": 2,
        "eval_strategy": "steps",
        "eval_steps": 3,
        "load_best_model_at_end": True,
        "metric_for_best_model": "loss",
        "greater_is_better": True,  # the worst loss is "best": an early step, not the last
    }
    out = train(server, work / f"limit-{world}", world=world, args=best_at_end)
    best = json.loads((out / "best-0.json").read_text())
    kept = checkpoints(out / "run")
    best_name, last = f"checkpoint-{best['step']}", f"checkpoint-{24 // world}"
    assert best_name != last
    assert kept == sorted([best_name, last])  # the best and the last, as the Trainer
    for name in kept:
        assert ss.verify(out / "run" / name).ok
    for rank in range(world):  # every rank loaded it
        final = ss.read_state(out / f"final-{rank}", ["model"])
        assert_tree_equal(final, ss.read_state(out / "run" / best_name, ["model"]))


def test_save_total_limit_without_a_best_keeps_the_last_n(server: LineServer, work: Path) -> None:
    out = train(server, work / "limit-last", args={"save_total_limit": 3, "save_steps": 2})
    assert checkpoints(out / "run") == ["checkpoint-20", "checkpoint-22", "checkpoint-24"]


def test_setups_that_write_their_own_checkpoints_are_refused() -> None:
    from snapstate.integrations.transformers import refuse_unsupported

    for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        trainer = SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=False)
        setattr(trainer, flag, True)
        with pytest.raises(ValueError, match=name) as refused:
            refuse_unsupported(trainer)
        assert "supported: one process or DDP" in str(refused.value)


def test_the_documented_recipe_runs_as_written_and_resumes(server: LineServer, work: Path) -> None:
    code = recipe(DOC, "Hugging Face Trainer")
    out = work / "recipe"
    train(server, out, script=code)
    run = out / "out"
    assert checkpoints(run) == ["checkpoint-12", "checkpoint-16"]
    manifest = run / "checkpoint-16" / "manifest.json"
    first, written = ss.read_state(run / "checkpoint-16"), manifest.stat().st_mtime_ns
    train(server, out, script=code)  # again: resumes from checkpoint-16, whose run is complete
    assert checkpoints(run) == ["checkpoint-12", "checkpoint-16"]
    assert manifest.stat().st_mtime_ns == written  # resumed at the end: nothing saved again
    assert_tree_equal(first, ss.read_state(run / "checkpoint-16"))


def test_the_model_of_a_trainer_checkpoint_exports_to_from_pretrained(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from integrations.test_hf_export import _load_and_compare, _tiny_gpt2
    from snapstate.integrations.transformers import SnapstateTrainer

    model = _tiny_gpt2().train()
    tokens = torch.randint(0, 101, (8, 16), generator=torch.Generator().manual_seed(2))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, save_steps=2, report_to="none", use_cpu=True
    )
    data = [{"input_ids": row, "labels": row} for row in tokens]
    SnapstateTrainer(model=model, args=args, train_dataset=data).train()
    model.config.save_pretrained(tmp_path / "cfg")
    config = tmp_path / "cfg" / "config.json"
    ss.export_hf(tmp_path / "out" / "checkpoint-2", tmp_path / "hf", key="model", config=config)
    _load_and_compare(model.eval(), tmp_path / "hf")  # the trained weights, bitwise logits

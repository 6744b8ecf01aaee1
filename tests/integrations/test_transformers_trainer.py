"""The Hugging Face Trainer with snapstate: a SIGKILLed and resumed train() is bitwise the
uninterrupted one.

Every run is a real Trainer in a process forked by ``hf_train.py`` (transformers is imported
once per module); the kills are real SIGKILLs. 64 samples, batches of 8: 8 steps an epoch,
3 epochs, a checkpoint every 3 steps unless a test says otherwise.
"""

from __future__ import annotations

import json
import os
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


@pytest.fixture(scope="module")
def server() -> Iterator[LineServer]:
    yield from trainer_server(SERVER)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_trainer")


def train(server: LineServer, out: Path, expect: int = 0, **config: Any) -> Path:
    """One run of hf_train.py; it must exit with ``expect`` (-9: killed)."""
    job = {"out": str(out), "mode": "snapstate", **config}
    code = server.ask(job, timeout=150)["code"]
    if code != expect:
        log = (out / "run.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"exit code {code}, expected {expect}:\n{log}")
    return out


def resume(server: LineServer, killed: Path, out: Path, **config: Any) -> Path:
    """Resume the run ``killed`` left behind: its output_dir, with ``resume`` (True or a path)."""
    args = {"output_dir": str(killed / "run"), **config.pop("args", {})}
    return train(server, out, args=args, **config)


def losses(out: Path) -> list[tuple[int, str]]:
    lines = (out / "losses.txt").read_text().split()
    return [(int(step), loss) for step, loss in zip(lines[::2], lines[1::2])]


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir())


@pytest.fixture(scope="module")
def reference(server: LineServer, work: Path) -> Path:
    """The uninterrupted run: the plain Trainer, saving nothing."""
    return train(server, work / "reference", mode="plain")


def assert_resumed_bitwise(reference: Path, killed: Path, resumed: Path, start: int) -> None:
    """The killed run's losses, then the resumed run's, are the reference's; so is the end state."""
    expected = losses(reference)
    before, after = losses(killed), losses(resumed)
    assert len(expected) == 24
    assert before == expected[: len(before)], "the killed run already differs"
    assert after[0][0] == start + 1 and start < len(before), f"resumed after step {after[0][0]}"
    assert after == expected[start:], "the resumed losses differ"
    assert_tree_equal(ss.read_state(reference / "final"), ss.read_state(resumed / "final"))


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


def test_save_total_limit_keeps_exactly_n_and_the_best_model_is_loaded_at_the_end(
    server: LineServer, work: Path
) -> None:
    best_at_end = {
        "save_total_limit": 2,
        "eval_strategy": "steps",
        "eval_steps": 3,
        "load_best_model_at_end": True,
        "metric_for_best_model": "loss",
        "greater_is_better": True,  # the worst loss is "best": an early step, not the last
    }
    out = train(server, work / "limit", args=best_at_end)
    best = json.loads((out / "best.json").read_text())
    kept = checkpoints(out / "run")
    best_name = f"checkpoint-{best['step']}"
    assert best_name != "checkpoint-24"
    assert kept == sorted([best_name, "checkpoint-24"])  # the best and the last, as the Trainer
    for name in kept:
        assert ss.verify(out / "run" / name).ok
    final = ss.read_state(out / "final", ["model"])
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

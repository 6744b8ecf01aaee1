"""Lightning with snapstate: a SIGKILLed and resumed Trainer.fit is bitwise the uninterrupted one.

Every run is a real Trainer in a process forked by ``lightning_train.py`` (lightning is imported
once per module); the kills are real SIGKILLs, the DDP runs two real processes on gloo.
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

pytestmark = needs("lightning")

SERVER = str(Path(__file__).with_name("lightning_train.py"))
DOC = Path(__file__).parents[2] / "docs" / "integrations.md"
KILLED = -9
STEPS_EVERY_3 = {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True}


@pytest.fixture(scope="module")
def server() -> Iterator[LineServer]:
    yield from trainer_server(SERVER)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lightning")


def train(server: LineServer, out: Path, expect: int = 0, **config: Any) -> Path:
    """One run of lightning_train.py; every rank must exit with ``expect`` (-9: killed)."""
    job = {"out": str(out), "ckpt_dir": str(out / "ckpt"), "mode": "snapstate", "ckpt": {}}
    job.update(config)
    codes = server.ask(job, timeout=150)["codes"]
    if any(code != expect for code in codes):
        logs = [p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("rank*.log"))]
        raise AssertionError(f"exit codes {codes}, expected {expect}:\n" + "\n---\n".join(logs))
    return out


def losses(out: Path, rank: int = 0) -> list[tuple[int, str]]:
    lines = (out / f"losses-{rank}.txt").read_text().split()
    return [(int(step), loss) for step, loss in zip(lines[::2], lines[1::2])]


@pytest.fixture(scope="module")
def reference(server: LineServer, work: Path) -> Path:
    """The uninterrupted run: plain Lightning, no checkpoint at all."""
    return train(server, work / "reference", mode="plain")


@pytest.fixture(scope="module")
def reference_ddp(server: LineServer, work: Path) -> Path:
    return train(server, work / "reference-ddp", mode="plain", world=2)


def assert_resumed_bitwise(reference: Path, killed: Path, resumed: Path, world: int = 1) -> None:
    """The killed run's losses, then the resumed run's, are the reference's; so is the end state."""
    for rank in range(world):
        expected = losses(reference, rank)
        before, after = losses(killed, rank), losses(resumed, rank)
        assert before == expected[: len(before)], f"rank {rank}: the killed run already differs"
        start = after[0][0]
        assert 0 < start < len(before), f"rank {rank}: resumed at step {start}"
        assert after == expected[start:], f"rank {rank}: the resumed losses differ"
    assert_tree_equal(ss.read_state(reference / "final"), ss.read_state(resumed / "final"))


def test_killed_mid_epoch_and_resumed_from_last_is_bitwise(
    server: LineServer, work: Path, reference: Path
) -> None:
    ckpt = work / "mid" / "ckpt"  # saves at steps 3 and 6 (8 batches an epoch); killed at 5
    killed = train(server, work / "mid", KILLED, ckpt=STEPS_EVERY_3, kill_at=5)
    assert ss.inspect(ckpt / "last.ckpt").tree is not None  # a committed snapstate checkpoint
    resumed = train(
        server, work / "mid-resumed", ckpt_dir=str(ckpt), ckpt=STEPS_EVERY_3, resume="last"
    )
    assert losses(resumed)[0][0] == 3
    assert_resumed_bitwise(reference, killed, resumed)


def test_killed_after_an_epoch_and_resumed_from_a_path_is_bitwise(
    server: LineServer, work: Path, reference: Path
) -> None:
    every_epoch = {"every_n_epochs": 1, "save_top_k": -1}
    killed = train(server, work / "epoch", KILLED, ckpt=every_epoch, kill_at=11)
    path = work / "epoch" / "ckpt" / "epoch=0-step=8.ckpt"
    resumed = train(server, work / "epoch-resumed", ckpt=every_epoch, resume=str(path))
    assert losses(resumed)[0][0] == 8
    assert_resumed_bitwise(reference, killed, resumed)


@pytest.mark.parametrize("mode", ["default", "io"])
def test_negative_control_without_the_callback_the_resume_is_not_bitwise(
    server: LineServer, work: Path, reference: Path, mode: str
) -> None:
    # The mid-epoch flow with Lightning's own CheckpointIO ("default") or snapstate's without
    # SnapstateCallback ("io"): the loader's order and dropout's RNG are not saved, so the
    # resumed losses part from the uninterrupted run's.
    ckpt = work / f"control-{mode}" / "ckpt"
    killed = train(
        server, work / f"control-{mode}", KILLED, mode=mode, ckpt=STEPS_EVERY_3, kill_at=5
    )
    resumed = train(
        server,
        work / f"control-{mode}-resumed",
        mode=mode,
        ckpt_dir=str(ckpt),
        ckpt=STEPS_EVERY_3,
        resume="last",
    )
    assert losses(killed) == losses(reference)[:5]
    assert losses(resumed)[0][0] == 3
    assert losses(resumed) != losses(reference)[3:]


def test_ddp_two_ranks_save_collectively_and_resume_bitwise(
    server: LineServer, work: Path, reference_ddp: Path
) -> None:
    # 4 batches per rank and epoch: saves at steps 3 and 6, killed at 5 on both ranks.
    ckpt = work / "ddp" / "ckpt"
    killed = train(server, work / "ddp", KILLED, world=2, ckpt=STEPS_EVERY_3, kill_at=5)
    manifest = ss.inspect(ckpt / "last.ckpt")
    assert manifest.world_size == 2
    assert sorted(manifest.rank_local) == [0, 1]  # each rank's RNG and loader position
    per_rank = manifest.totals["bytes_per_rank"]
    assert len(per_rank) == 2 and all(int(b) > 0 for b in per_rank)  # both ranks wrote a share
    resumed = train(
        server,
        work / "ddp-resumed",
        world=2,
        ckpt_dir=str(ckpt),
        ckpt=STEPS_EVERY_3,
        resume="last",
    )
    assert_resumed_bitwise(reference_ddp, killed, resumed, world=2)


@pytest.fixture(scope="module")
def top_k(server: LineServer, work: Path) -> Path:
    ckpt = {"monitor": "train_loss", "save_top_k": 2, "every_n_train_steps": 2, "save_last": True}
    return train(server, work / "topk", ckpt=ckpt)


def test_top_k_leaves_exactly_k_committed_checkpoints(top_k: Path) -> None:
    kept = json.loads((top_k / "kept.json").read_text())
    ckpt = top_k / "ckpt"
    named = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("."))
    assert len(kept["best_k"]) == 2
    assert named == sorted([*(Path(p).name for p in kept["best_k"]), "last.ckpt"])
    for name in named:
        assert ss.verify(ckpt / name).ok
    # each name links to its version; no other version is left behind
    versions = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("."))
    assert versions == sorted(os.readlink(ckpt / name) for name in named)


def test_load_from_checkpoint_reads_a_snapstate_directory(top_k: Path) -> None:
    from integrations.lightning_train import Tiny

    path = top_k / "ckpt" / "last.ckpt"
    model = Tiny.load_from_checkpoint(path)
    stored = ss.read_state(path, ["state_dict", "hyper_parameters"])
    assert model.hparams.width == stored["hyper_parameters"]["width"] == 8
    assert_tree_equal(dict(model.state_dict()), stored["state_dict"])


def test_strategies_that_bypass_the_checkpoint_io_are_refused_at_setup() -> None:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from snapstate.integrations.lightning import SnapstateCallback

    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        trainer = SimpleNamespace(strategy=strategy)
        with pytest.raises(ValueError, match=type(strategy).__name__) as refused:
            SnapstateCallback().setup(trainer, None, "fit")
        assert "supported: SingleDeviceStrategy" in str(refused.value)
        assert "DDPStrategy" in str(refused.value)


def test_the_documented_recipe_runs_as_written_and_resumes(server: LineServer, work: Path) -> None:
    code = recipe(DOC, "Lightning")
    out = work / "recipe"
    train(server, out, script=code)
    ckpt = out / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "epoch=1-step=12.ckpt",
        "epoch=1-step=16.ckpt",
        "last.ckpt",
    ]
    first = ss.read_state(ckpt / "last.ckpt", ["global_step", "state_dict"])
    assert first["global_step"] == 16
    train(server, out, script=code)  # again: resumes from last.ckpt, whose run is complete
    assert (
        f"Restored all states from the checkpoint at {ckpt / 'last.ckpt'}"
        in (out / "rank0.log").read_text()
    )
    again = ss.read_state(ckpt / "last.ckpt", ["global_step", "state_dict"])
    assert_tree_equal(first, again)


KILLED_WHILE_OVERWRITING = """
import os, signal, torch
from snapstate.integrations.lightning import SnapstateCheckpointIO

io = SnapstateCheckpointIO()
io.save_checkpoint({"w": torch.zeros(4)}, "last.ckpt")
io.wait()
io.save_checkpoint({"w": torch.ones(16 << 20)}, "last.ckpt")  # staged, still being written
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_save_killed_while_it_overwrites_last_leaves_the_previous_one(
    server: LineServer, work: Path
) -> None:
    out = train(server, work / "overwrite", KILLED, script=KILLED_WHILE_OVERWRITING)
    assert_tree_equal(ss.read_state(out / "last.ckpt"), {"w": torch.zeros(4)})

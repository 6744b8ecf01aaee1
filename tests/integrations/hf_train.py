"""A tiny Hugging Face Trainer run for the kill-and-resume tests, and its fork server.

Run as a script it reads one JSON job per line on stdin, forks one process per rank for it
(transformers is imported once, here) and answers ``{"codes": [exit code per rank]}``. A job:

    {"out": dir, "world": 1 or 2, "mode": "snapstate" | "no-rng" | "rank0-rng" | "plain",
     "args": {TrainingArguments}, "kill_at": step, "kill_on_save": step,
     "resume": true or a path, "blocking": bool, "slow_publish": seconds}

``world`` 2 runs DDP on gloo over loopback, each rank given torchrun's environment. ``mode``:
"snapstate" trains with SnapstateTrainer (the recipe), "no-rng" with SnapstateTrainer that does
not restore the RNG on resume, "rank0-rng" with one that restores rank 0's RNG on every rank
(the negative controls), "plain" with the Trainer saving nothing. ``kill_at``: every rank
stops at that step once its last save is committed, ``kill_on_save``: right after that step's
save started; once all have stopped this server SIGKILLs them all at once, as a node failure
would. ``blocking`` makes the saves synchronous. Each rank appends "step loss.hex()" lines to
``out/losses-RANK.txt`` and, when a save of ``on_save`` was made, its torch RNG state then to
``out/rng-RANK-STEP.bin``; when training ends every rank saves its model and optimizer with
snapstate, on its own, to ``out/final-RANK``, and what ``trainer.state`` says of the best
checkpoint to ``out/best-RANK.json``. ``slow_publish``: rank 0 renames each committed
checkpoint into place that many seconds late. Under DDP each rank draws ``rank`` numbers once the
Trainer is made, so the ranks' RNG states differ (dropout's masks too): a rank resumed with
another's would be seen. A job ``{"out": dir, "script": code}`` runs ``code`` in ``dir``
instead (a documented recipe).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

import snapstate as ss
from snapstate.integrations.transformers import SnapstateTrainer

# Run as a script, this file finds the shared support where the tests do: tests/ on the path.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from support.integrations import exit_after, run_job  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),  # draws from the global RNG every step
            torch.nn.Linear(8, 1),
        )
        self.last_loss = torch.zeros(())

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = torch.nn.functional.mse_loss(self.net(x), labels)
        self.last_loss = loss.detach()
        return {"loss": loss}


def dataset(n: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return [{"x": row, "labels": row.sum(0, keepdim=True)} for row in x]


class Record(TrainerCallback):
    """Log every step's loss and each save's RNG; stop for the kill at ``kill_at`` steps."""

    def __init__(self, model: Tiny, out: Path, rank: int, config: dict[str, Any]) -> None:
        self.model, self.out, self.rank = model, out, rank
        self.kill_at, self.kill_on_save = config.get("kill_at"), config.get("kill_on_save")
        self.trainer: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with (self.out / f"losses-{self.rank}.txt").open("a") as f:
            f.write(f"{state.global_step} {self.model.last_loss.item().hex()}\n")
        if state.global_step == self.kill_at:  # before this step's save, if it has one
            wait = getattr(self.trainer, "wait_for_checkpoint", None)
            if wait is not None:
                wait()  # the kill comes once the last checkpoint is committed
            stop_for_the_kill(self.out, self.rank)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Nothing draws between the checkpoint's RNG snapshot and here.
        rng = self.out / f"rng-{self.rank}-{state.global_step}.bin"
        rng.write_bytes(torch.get_rng_state().numpy().tobytes())
        if state.global_step == self.kill_on_save:  # the save just started may be in flight
            stop_for_the_kill(self.out, self.rank)


def stop_for_the_kill(out: Path, rank: int) -> None:
    """Tell the launcher this rank has stopped, and wait there for its SIGKILL."""
    (out / f"stopped-{rank}").touch()
    while True:
        time.sleep(1)


class NoRNGTrainer(SnapstateTrainer):
    """The negative control: resumes model, optimizer and scheduler, but not the RNG."""

    def _load_rng_state(self, checkpoint: str | None) -> None:
        pass


class Rank0RNGTrainer(SnapstateTrainer):
    """The DDP negative control: every rank resumes with rank 0's RNG (one RNG for the job)."""

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self.wait_for_checkpoint()
            ss.RNGState().load_state_dict(ss.read_state(checkpoint, ["rng"], rank=0)["rng"])


TRAINERS: dict[str, type[Trainer]] = {
    "snapstate": SnapstateTrainer,
    "no-rng": NoRNGTrainer,
    "rank0-rng": Rank0RNGTrainer,
    "plain": Trainer,
}


def main(config: dict[str, Any]) -> None:
    out = Path(config["out"])
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(7)
    model = Tiny()
    args = {
        "output_dir": str(out / "run"),
        "num_train_epochs": 3,
        "per_device_train_batch_size": 8,
        "learning_rate": 0.05,
        "lr_scheduler_type": "linear",
        "warmup_steps": 2,
        "seed": 7,
        "save_strategy": "no" if config["mode"] == "plain" else "steps",
        "save_steps": 3,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        **config.get("args", {}),
    }
    record = Record(model, out, rank, config)
    blocking = {"snapstate_async": False} if config.get("blocking") else {}
    trainer = TRAINERS[config["mode"]](
        **blocking,
        model=model,
        args=TrainingArguments(**args),
        train_dataset=dataset(),
        eval_dataset=dataset(16, seed=1),
        callbacks=[record],
    )
    record.trainer = trainer
    if rank == 0 and config.get("slow_publish"):
        slow_down_the_rename(config["slow_publish"])
    torch.rand(rank)  # the ranks' RNG states part; torch.initial_seed(), the sampler's, stays
    trainer.train(resume_from_checkpoint=config.get("resume"))
    save_final(model, trainer.optimizer, out / f"final-{rank}")
    best = {"best": trainer.state.best_model_checkpoint, "step": trainer.state.best_global_step}
    (out / f"best-{rank}.json").write_text(json.dumps(best))


def slow_down_the_rename(seconds: float) -> None:
    """Rank 0 renames each committed checkpoint into place ``seconds`` late (a slow file system)."""
    from snapstate.integrations import transformers as plugin

    rename = plugin.replace_dir

    def slow(source: str, path: str) -> None:
        time.sleep(seconds)
        rename(source, path)

    plugin.replace_dir = slow


def save_final(model: Tiny, optimizer: Any, path: Path) -> None:
    """This rank's model and optimizer, saved by this rank alone: every rank's end compared."""
    group = None
    if dist.is_initialized():  # a group of one per rank (every rank makes every group)
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        group = groups[dist.get_rank()]
    ss.save({"model": model, "optim": optimizer}, path, process_group=group)
    if dist.is_initialized():  # rank 0 hosts the store the others' saves still commit through
        dist.barrier()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child(config: dict[str, Any], rank: int, port: int) -> None:
    def body() -> None:
        torch.set_num_threads(1)  # the machine is shared
        world = config.get("world", 1)
        if world > 1:  # launched from outside, as torchrun does: its environment
            env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "WORLD_SIZE": world}
            env.update(LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            os.environ.update({k: str(v) for k, v in env.items()})
        run_job(config, main)

    exit_after(Path(config["out"]) / f"rank{rank}.log", body)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Fork the ranks and wait for them; their exit codes. Once every rank has stopped for the
    kill, or at the timeout, SIGKILL them all at once (a node failure)."""
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    for stopped in out.glob("stopped-*"):  # an earlier run's in the same folder
        stopped.unlink()
    world, port = config.get("world", 1), free_port()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            child(config, rank, port)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + config.get("timeout", 120)
    while len(codes) < world and time.monotonic() < deadline:
        if all((out / f"stopped-{r}").exists() for r in range(world)):
            break
        for rank, pid in enumerate(pids):
            done, status = (0, 0) if rank in codes else os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for rank, pid in enumerate(pids):  # the ranks left: stopped for the kill, or hung
        if rank not in codes:
            os.kill(pid, signal.SIGKILL)
    for rank, pid in enumerate(pids):
        if rank not in codes:
            codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return {"codes": [codes[r] for r in range(world)]}


if __name__ == "__main__":
    for line in sys.stdin:
        sys.stdout.write(json.dumps(run(json.loads(line))) + "\n")
        sys.stdout.flush()

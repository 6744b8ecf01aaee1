"""A tiny Hugging Face Trainer run for the kill-and-resume tests, and its fork server.

Run as a script it reads one JSON job per line on stdin, forks one process for it (transformers
is imported once, here) and answers ``{"code": exit code}``. A job:

    {"out": dir, "mode": "snapstate" | "no-rng" | "plain", "args": {TrainingArguments},
     "kill_at": step, "kill_on_save": step, "resume": true or a path, "blocking": bool}

``mode``: "snapstate" trains with SnapstateTrainer (the recipe), "no-rng" with SnapstateTrainer
that does not restore the RNG on resume (the negative control), "plain" with the Trainer
saving nothing. ``kill_at`` SIGKILLs the run at that step once its last save is committed,
``kill_on_save`` right after that step's save started; ``blocking`` makes the saves
synchronous. Each run appends "step loss.hex()" lines to ``out/losses.txt``; when training
ends it saves the model and optimizer with snapstate to ``out/final`` and writes what
``trainer.state`` says of the best checkpoint to ``out/best.json``. A job ``{"out": dir,
"script": code}`` runs ``code`` in ``dir`` instead (a documented recipe).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
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
    """Log every step's loss; SIGKILL the process after ``kill_at`` steps."""

    def __init__(self, model: Tiny, log: Path, config: dict[str, Any]) -> None:
        self.model, self.log = model, log
        self.kill_at, self.kill_on_save = config.get("kill_at"), config.get("kill_on_save")
        self.trainer: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.log.open("a") as f:
            f.write(f"{state.global_step} {self.model.last_loss.item().hex()}\n")
        if state.global_step == self.kill_at:  # before this step's save, if it has one
            wait = getattr(self.trainer, "wait_for_checkpoint", None)
            if wait is not None:
                wait()  # the kill comes once the last checkpoint is committed
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.kill_on_save:  # the save just started may be in flight
            os.kill(os.getpid(), signal.SIGKILL)


class NoRNGTrainer(SnapstateTrainer):
    """The negative control: resumes model, optimizer and scheduler, but not the RNG."""

    def _load_rng_state(self, checkpoint: str | None) -> None:
        pass


TRAINERS: dict[str, type[Trainer]] = {
    "snapstate": SnapstateTrainer,
    "no-rng": NoRNGTrainer,
    "plain": Trainer,
}


def main(config: dict[str, Any]) -> None:
    out = Path(config["out"])
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
    record = Record(model, out / "losses.txt", config)
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
    trainer.train(resume_from_checkpoint=config.get("resume"))
    ss.save({"model": model, "optim": trainer.optimizer}, out / "final")
    best = {"best": trainer.state.best_model_checkpoint, "step": trainer.state.best_global_step}
    (out / "best.json").write_text(json.dumps(best))


def child(config: dict[str, Any]) -> None:
    def body() -> None:
        torch.set_num_threads(1)  # the machine is shared
        run_job(config, main)

    exit_after(Path(config["out"]) / "run.log", body)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Fork the run and wait for it (SIGKILLed at the timeout); its exit code."""
    Path(config["out"]).mkdir(parents=True, exist_ok=True)
    pid = os.fork()
    if pid == 0:
        child(config)
    deadline = time.monotonic() + config.get("timeout", 120)
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"code": os.waitstatus_to_exitcode(status)}
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    return {"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}


if __name__ == "__main__":
    for line in sys.stdin:
        sys.stdout.write(json.dumps(run(json.loads(line))) + "\n")
        sys.stdout.flush()

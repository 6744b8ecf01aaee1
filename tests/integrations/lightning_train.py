"""A tiny Lightning run for the kill-and-resume tests, and the fork server that starts it.

Run as a script it reads one JSON job per line on stdin, forks one process per rank (lightning
is imported once, here) and answers ``{"codes": [...]}`` when every rank has exited. A job:

    {"out": dir, "world": 1 or 2, "mode": "snapstate" | "io" | "default" | "plain", "ckpt": {},
     "ckpt_dir": dir, "kill_at": step or null, "resume": ckpt_path or null, "timeout": s}

``mode``: "snapstate" adds SnapstateCheckpointIO and SnapstateCallback (the recipe), "io" the
CheckpointIO alone, "default" keeps Lightning's own checkpointing, "plain" saves nothing. ``ckpt`` holds the
ModelCheckpoint arguments. Each rank appends "step loss.hex()" lines to losses-RANK.txt and,
when training ends, the ranks save the model and optimizer with snapstate to ``out/final`` and
rank 0 writes what its ModelCheckpoint kept to ``out/kept.json``. A job ``{"out": dir,
"script": code}`` runs ``code`` in ``dir`` instead (a documented recipe).
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

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import snapstate as ss
from snapstate.integrations.lightning import SnapstateCallback, SnapstateCheckpointIO

# Run as a script, this file finds the shared support where the tests do: tests/ on the path.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from support.integrations import exit_after, run_job  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),  # draws from the global RNG every step
            torch.nn.Linear(width, 1),
        )
        self.log_file: Path | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)  # what top-k monitors
        if self.log_file is not None:
            with self.log_file.open("a") as f:
                f.write(f"{self.global_step} {loss.item().hex()}\n")
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)]


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


class KillAt(Callback):
    """SIGKILL this process after ``step`` optimizer steps, once the last save is committed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            io = trainer.strategy.checkpoint_io
            if isinstance(io, SnapstateCheckpointIO):
                io.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def callbacks_for(config: dict[str, Any]) -> tuple[list[Callback], list[Any]]:
    """The run's callbacks and plugins: the recipe adds one of each."""
    callbacks: list[Callback] = []
    plugins: list[Any] = []
    if config["mode"] != "plain":
        callbacks.append(ModelCheckpoint(dirpath=config["ckpt_dir"], **config["ckpt"]))
    if config["mode"] in ("snapstate", "io"):
        plugins.append(SnapstateCheckpointIO())
    if config["mode"] == "snapstate":
        callbacks.append(SnapstateCallback())
    if config.get("kill_at"):
        callbacks.append(KillAt(config["kill_at"]))
    return callbacks, plugins


def main(config: dict[str, Any]) -> None:
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(7, workers=True)
    model = Tiny()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    model.log_file = out / f"losses-{rank}.txt"
    callbacks, plugins = callbacks_for(config)
    world = config.get("world", 1)
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        deterministic=True,
        plugins=plugins,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(model, loader(), ckpt_path=config.get("resume"))
    ss.save({"model": model, "optim": trainer.optimizers[0]}, out / "final")  # collective on DDP
    checkpoint = trainer.checkpoint_callback
    if rank == 0 and isinstance(checkpoint, ModelCheckpoint):
        kept = {"best_k": sorted(checkpoint.best_k_models), "last": checkpoint.last_model_path}
        (out / "kept.json").write_text(json.dumps(kept))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child(config: dict[str, Any], rank: int, port: int) -> None:
    def body() -> None:
        torch.set_num_threads(1)  # the ranks share two cores
        if config.get("world", 1) > 1:  # launched from outside, as torchrun would
            env = {"LOCAL_RANK": rank, "RANK": rank, "NODE_RANK": 0, "WORLD_SIZE": config["world"]}
            os.environ.update({k: str(v) for k, v in env.items()})
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        run_job(config, main)

    exit_after(Path(config["out"]) / f"rank{rank}.log", body)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Fork the ranks, wait for them (SIGKILL those left at the timeout); their exit codes."""
    Path(config["out"]).mkdir(parents=True, exist_ok=True)
    port = free_port()
    pids = []
    for rank in range(config.get("world", 1)):
        pid = os.fork()
        if pid == 0:
            child(config, rank, port)
        pids.append(pid)
    deadline = time.monotonic() + config.get("timeout", 120)
    codes: dict[int, int] = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for rank, pid in enumerate(pids):
            done, status = (0, 0) if rank in codes else os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for rank, pid in enumerate(pids):
        if rank not in codes:
            os.kill(pid, signal.SIGKILL)
            codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return {"codes": [codes[r] for r in range(len(pids))]}


if __name__ == "__main__":
    for line in sys.stdin:
        sys.stdout.write(json.dumps(run(json.loads(line))) + "\n")
        sys.stdout.flush()

"""A tiny Accelerate loop for the kill-and-resume tests: one process per rank, run as a script.

    python accelerate_train.py OUT CKPT MODE [--stateful] [--seedable] [--workers W]
        [--kill-at N] [--every K] [--resume]

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (gloo on CPU). MODE is "snapstate"
(SnapstateAccelerate), "accelerate" (Accelerator.save_state/load_state) or "plain" (no
checkpoint). 3 epochs of 8 batches per process; a checkpoint after steps 3, 6, 9... (--every K: K, 2K...) to CKPT;
a resume in "accelerate" mode skips the epoch's trained batches with skip_first_batches.
``--kill-at N`` SIGKILLs the process after step N, once the last save is committed. Each rank
writes "step loss.hex()" lines to OUT/losses-RANK.txt and, at the end, the model and optimizer
to OUT/final with snapstate.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

import snapstate as ss
from snapstate.integrations.accelerate import SnapstateAccelerate

EPOCHS, EVERY = 3, 3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("ckpt")
    p.add_argument("mode", choices=["snapstate", "accelerate", "plain"])
    p.add_argument("--stateful", action="store_true")
    p.add_argument("--seedable", action="store_true")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--every", type=int, default=EVERY)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--workers", type=int, default=0, help="loader workers; their batches get noise")
    a = p.parse_args()
    out = Path(a.out)
    config = DataLoaderConfiguration(
        use_stateful_dataloader=a.stateful, use_seedable_sampler=a.seedable
    )
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    set_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4, generator=g)
    data = Noisy(x) if a.workers else TensorDataset(x, x.sum(1, keepdim=True))
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=a.workers)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    ckpt = SnapstateAccelerate(accelerator) if a.mode == "snapstate" else None
    step = 0
    if a.resume and ckpt is not None:
        step = ckpt.load(a.ckpt)["step"]
    elif a.resume:
        accelerator.load_state(a.ckpt)
        step = int(Path(a.ckpt, "step.txt").read_text())
    log = (out / f"losses-{accelerator.process_index}.txt").open("a")
    first_epoch, skip = divmod(step, len(loader))
    for epoch in range(first_epoch, EPOCHS):
        epoch_loader = loader
        if ckpt is None and epoch == first_epoch and skip:
            epoch_loader = accelerator.skip_first_batches(loader, skip)
        for x_batch, y_batch in epoch_loader:
            loss = torch.nn.functional.mse_loss(model(x_batch), y_batch)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            log.write(f"{step} {loss.item().hex()}\n")
            log.flush()
            if step % a.every == 0 and a.mode != "plain":
                save(accelerator, ckpt, a.ckpt, step)
            if step == a.kill_at:
                if ckpt is not None:
                    ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    if ckpt is not None:
        ckpt.wait()
    final = {
        "model": accelerator.unwrap_model(model).state_dict(),
        "opt": opt.optimizer.state_dict(),
    }
    ss.save(final, out / "final")


class Noisy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples with noise drawn in the worker: its seed comes from the loader's iterator."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noisy = self.x[i] + 0.1 * torch.randn(4)
        return noisy, noisy.sum(0, keepdim=True)


def save(accelerator: Accelerator, ckpt: SnapstateAccelerate | None, path: str, step: int) -> None:
    if ckpt is not None:
        ckpt.save(path, extra={"step": step})
        return
    accelerator.save_state(path)
    if accelerator.is_main_process:
        Path(path, "step.txt").write_text(str(step))


if __name__ == "__main__":
    main()

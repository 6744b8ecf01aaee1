"""The glue's cost: each trainer plug-in's blocking time per save against ``ss.async_save`` of
the same state, in the same run, during real training.

The Hugging Face Trainer (``SnapstateTrainer``) and an Accelerate loop (``SnapstateAccelerate``)
train a GPT-2-shaped model with AdamW on CPU. At every checkpoint the plug-in's save and an
``ss.async_save`` of the very state it writes are timed back to back, in alternating order,
each after the previous save has committed, so neither pays for the other's background half.
Blocking is the call until it returns (the plug-in's whole ``_save_checkpoint`` or ``save``:
trainer state, callbacks, version directory, publication set up). Lightning's plug-in is
measured by ``snapstate bench --preset integrations``. Run in ``.venv-integrations``; under
``torchrun --nproc-per-node 2`` for 2 processes (gloo)::

    .venv-integrations/bin/python benchmarks/bench_plugins.py [--trainer hf|accelerate|both]
        [--steps 40] [--every 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import snapstate as ss

VOCAB, SEQ, BATCH = 8192, 32, 2  # the state is what is timed; little compute per step


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4)
    return GPT2LMHeadModel(config)


def tokens(samples: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class PairTimer:
    """Times the plug-in's save and the baseline's, alternating which goes first."""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch
        self.plugin_s: list[float] = []
        self.baseline_s: list[float] = []
        self._count = 0

    def pair(
        self,
        plugin: Callable[[], None],
        wait_plugin: Callable[[], None],
        state: Callable[[], Any],
    ) -> None:
        """``state`` builds what the plug-in writes; the baseline's clock includes building
        it, as a loop that called ``ss.async_save`` itself would."""
        first_plugin = self._count % 2 == 0
        self._count += 1
        for which in ("plugin", "baseline") if first_plugin else ("baseline", "plugin"):
            if which == "plugin":
                self.plugin_s.append(_timed(plugin))
                wait_plugin()
            else:
                self.baseline_s.append(self._baseline(state))

    def _baseline(self, state: Callable[[], Any]) -> float:
        target = os.path.join(self.scratch, f"baseline-{self._count}")
        handle: list[Any] = []
        seconds = _timed(lambda: handle.append(ss.async_save(state(), target)))
        handle[0].wait()
        if _rank() == 0:  # off the clock: one fresh path per save, as the plug-ins write
            shutil.rmtree(target, ignore_errors=True)
        return seconds

    def summary(self) -> dict[str, Any]:
        # the first pair pays one-time costs (first staging buffers, plan caches): left out
        plugin, baseline = self.plugin_s[1:], self.baseline_s[1:]
        return {
            "saves": len(plugin),
            "plugin_ms": 1e3 * statistics.median(plugin),
            "baseline_ms": 1e3 * statistics.median(baseline),
            "ratio": statistics.median(plugin) / statistics.median(baseline),
            "plugin_all_ms": [round(1e3 * s, 2) for s in self.plugin_s],
            "baseline_all_ms": [round(1e3 * s, 2) for s in self.baseline_s],
        }


def run_hf(steps: int, every: int, work: str) -> dict[str, Any]:
    from transformers import TrainingArguments

    from snapstate.integrations.transformers import SnapstateTrainer

    timer = PairTimer(os.path.join(work, "scratch"))

    class TimedTrainer(SnapstateTrainer):
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            self.wait_for_checkpoint()  # the previous save's background half, off the clock
            timer.pair(
                lambda: SnapstateTrainer._save_checkpoint(self, model, trial),
                self.wait_for_checkpoint,
                self._checkpoint_state,
            )

    args = TrainingArguments(
        output_dir=os.path.join(work, "hf"),
        max_steps=steps,
        save_steps=every,
        save_total_limit=2,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-4,
        logging_steps=10**6,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = TimedTrainer(model=gpt2(), args=args, train_dataset=tokens(BATCH * steps * 2))
    trainer.train()
    return timer.summary()


def run_accelerate(steps: int, every: int, work: str) -> dict[str, Any]:
    from accelerate import Accelerator

    from snapstate.integrations.accelerate import SnapstateAccelerate

    accelerator = Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(tokens(BATCH * steps * 2), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plugin = SnapstateAccelerate(accelerator)
    timer = PairTimer(os.path.join(work, "scratch"))
    for step, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % every == 0:
            save = functools.partial(plugin.save, os.path.join(work, "acc", "last"), {"step": step})
            timer.pair(save, plugin.wait, plugin.state)
        if step == steps:
            break
    plugin.wait()
    return timer.summary()


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def shared_workdir() -> str:
    """One scratch directory for every process (rank 0 makes it; the others are told)."""
    made = [tempfile.mkdtemp(prefix="bench-plugins-", dir=".") if _rank() == 0 else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(made, src=0)
    return made[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainer", choices=("hf", "accelerate", "both"), default="both")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    work = shared_workdir()
    results: dict[str, Any] = {"args": vars(args), "ranks": int(os.environ.get("WORLD_SIZE", 1))}
    try:
        if args.trainer in ("hf", "both"):
            results["hf-trainer"] = run_hf(args.steps, args.every, os.path.join(work, "hf-run"))
        if args.trainer in ("accelerate", "both"):
            results["accelerate"] = run_accelerate(
                args.steps, args.every, os.path.join(work, "acc-run")
            )
    finally:
        if dist.is_initialized():
            dist.barrier()
        if _rank() == 0:
            shutil.rmtree(work, ignore_errors=True)
    if _rank() == 0:
        report(results, args.json)


def report(results: dict[str, Any], json_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plug-in blocking per save vs ss.async_save, {results['ranks']} rank(s)")
    for col in ("trainer", "saves", "plug-in ms", "ss.async_save ms", "ratio"):
        table.add_column(col)
    for name in ("hf-trainer", "accelerate"):
        if name in results:
            r = results[name]
            table.add_row(
                name,
                str(r["saves"]),
                f"{r['plugin_ms']:.1f}",
                f"{r['baseline_ms']:.1f}",
                f"{r['ratio']:.2f}x",
            )
    Console().print(table)


if __name__ == "__main__":
    main()

"""Hugging Face Trainer: checkpoints written and read by snapstate, resumed bit for bit.

    trainer = SnapstateTrainer(model=model, args=args, train_dataset=data)  # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)

``SnapstateTrainerMixin`` replaces the Trainer's checkpoint writing and reading (``torch.save``
pickles of the optimizer, scheduler, scaler and RNG, safetensors of the model) by one snapstate
checkpoint per ``checkpoint-N`` directory: model, optimizer, scheduler, gradient scaler and
every global RNG of every rank (saved per rank), asynchronously by default. The Trainer's own
``trainer_state.json`` is written beside snapstate's manifest, so ``get_last_checkpoint``,
``save_total_limit``, ``load_best_model_at_end`` and the loader's fast-forward on resume (its
sampler is seeded per epoch, its position is the global step) work as with the Trainer's files.
Mix it into a Trainer subclass (``class T(SnapstateTrainerMixin, Seq2SeqTrainer)``) or use
``SnapstateTrainer``. DeepSpeed, FSDP, SageMaker MP and XLA, which write their own
checkpoints, are refused when training starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from typing import TYPE_CHECKING, Any

from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

import snapstate as ss
from snapstate.integrations import _publish
from snapstate.integrations._read import dist_world, is_checkpoint_dir

TRAINER_STATE = "trainer_state.json"
SUPPORTED = (
    "one process or DDP (torchrun), on CPU or GPU, without DeepSpeed, FSDP, SageMaker MP or XLA"
)


class SnapstateTrainerMixin:
    """A Trainer whose checkpoints are snapstate checkpoints (see the module docstring).

    ``snapstate_async=True`` returns from each save once the state is staged; training goes on
    while it is written. Each save goes to a hidden sibling of ``checkpoint-N`` that is renamed
    to it once committed and its ``trainer_state.json`` written, so a killed save leaves no
    ``checkpoint-N`` behind for ``resume_from_checkpoint=True`` to pick; older checkpoints are
    rotated (``save_total_limit``) only then. The next save, a load and the end of ``train``
    wait for the save in flight (``wait_for_checkpoint``).
    """

    if TYPE_CHECKING:  # the Trainer's, once mixed in
        args: Any
        state: Any
        model: Any
        optimizer: Any
        lr_scheduler: Any
        accelerator: Any
        control: Any
        callback_handler: Any
        hp_search_backend: Any

        def store_flos(self) -> None: ...
        def _get_output_dir(self, trial: Any) -> str: ...

    def __init__(
        self,
        *args: Any,
        snapstate_async: bool = True,
        snapstate_options: ss.SaveOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.snapstate_async = snapstate_async
        self.snapstate_options = snapstate_options
        self._in_flight = _publish.InFlight()

    # ---- saving ----

    def train(self, *args: Any, **kwargs: Any) -> Any:
        refuse_unsupported(self)
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.wait_for_checkpoint()

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self.wait_for_checkpoint()  # one save in flight: the last one is published first
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._note_best(run_dir)
        self._store_callback_states()
        target = _publish.version_dir(path, "new")
        publish = _Publication(
            path=path,
            target=target,
            run_dir=run_dir,
            trainer_state=self._trainer_state_json(),
            args=self.args,
            best=self.state.best_model_checkpoint,
        )
        state = self._checkpoint_state()
        if not self.snapstate_async:
            ss.save(state, target, overwrite=True, options=self.snapstate_options)
            publish()
            return
        handle = ss.async_save(state, target, overwrite=True, options=self.snapstate_options)
        self._in_flight.start(handle, publish)

    def wait_for_checkpoint(self) -> None:
        """Block until the save in flight is committed and published (raises its error)."""
        self._in_flight.wait()

    def _checkpoint_state(self) -> dict[str, Any]:
        """What a resume needs, as snapstate state: the values of this moment."""
        state: dict[str, Any] = {"model": self.model, "rng": ss.RNGState()}
        if not self.args.save_only_model:
            state["optimizer"] = self.optimizer
            state["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
        return state

    def _note_best(self, run_dir: str) -> None:
        # The Trainer's rule: the best step's checkpoint, once it exists (this save makes it).
        best_step = self.state.best_global_step
        if best_step and self.args.save_strategy in ("steps", "epoch", "best"):
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if best_step == self.state.global_step or os.path.isdir(best):
                self.state.best_model_checkpoint = best

    def _store_callback_states(self) -> None:
        # As the Trainer does before writing trainer_state.json: the stateful callbacks' state now.
        handler = self.callback_handler
        stored = self.state.stateful_callbacks
        for cb in [*handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if isinstance(stored[name], list):
                    stored[name].append(cb.state())
                else:
                    stored[name] = cb.state()

    def _trainer_state_json(self) -> str:
        # TrainerState.save_to_json's text, taken now: the save may be written later.
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    # ---- loading (each falls back to the Trainer's own files) ----

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._ours(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        ss.load({"model": self.model if model is None else model}, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        state = {"optimizer": self.optimizer, "scheduler": self.lr_scheduler}
        ss.load(state, checkpoint)  # type: ignore[arg-type]

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            ss.load({"scaler": scaler}, checkpoint)  # type: ignore[arg-type]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        if checkpoint is not None and rngs_fit(checkpoint):
            ss.load({"rng": ss.RNGState()}, checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not self._ours(best):
            return super()._load_best_model()  # type: ignore[misc]
        ss.load({"model": self.model}, best)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_for_checkpoint()  # the best model and the last rotation need the last save
        # Under DDP only rank 0 renames; the Trainer's next collective (store_flos) holds the
        # others until it has, so every rank finds the best checkpoint where rank 0 does (and
        # loads it with rank 0: ss.load is collective). _save_checkpoint waits in that order too.
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    def _ours(self, checkpoint: str | None) -> bool:
        self.wait_for_checkpoint()
        return checkpoint is not None and is_checkpoint_dir(checkpoint)


@dataclasses.dataclass(frozen=True)
class _Publication:
    """What is left of a save once snapstate committed it: one rank renames, then rotates."""

    path: str
    target: str
    run_dir: str
    trainer_state: str
    args: Any
    best: str | None

    def __call__(self) -> None:
        if not self.args.should_save:  # the other ranks' wait saw the commit; one renames
            return
        with open(os.path.join(self.target, TRAINER_STATE), "w", encoding="utf-8") as f:
            f.write(self.trainer_state)
        replace_dir(self.target, self.path)
        rotate_checkpoints(
            output_dir=self.run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.best,
        )


def rngs_fit(checkpoint: str) -> bool:
    """True when ``checkpoint`` was saved on this run's world size; else warn.

    The Trainer's rule for its own files: the per-rank RNGs of another world size are
    skipped and the rest resumes (a DDP job resumed on fewer ranks after a node failure).
    """
    saved_on, world = ss.inspect(checkpoint).world_size, dist_world()
    if saved_on != world:
        warnings.warn(
            f"{checkpoint} holds the RNG states of world size {saved_on}, this run's is "
            f"{world}: they are not restored, the resume is not reproducible",
            stacklevel=3,
        )
    return saved_on == world


def replace_dir(source: str, path: str) -> None:
    """Rename the committed ``source`` to ``path``; a checkpoint already there is removed after.

    A plain directory, not a link: the Trainer deletes rotated checkpoints with rmtree.
    """
    old = None
    if os.path.lexists(path):  # the same step saved again (a resume from an earlier one)
        old = _publish.version_dir(path, "old")
        _publish.remove(old)
        os.rename(path, old)
    os.rename(source, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def refuse_unsupported(trainer: Any) -> None:
    """Raise unless the Trainer hands its checkpoints to ``_save_checkpoint`` whole."""
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

    found = [
        name
        for name, on in (
            ("DeepSpeed", trainer.is_deepspeed_enabled),
            ("FSDP", trainer.is_fsdp_enabled),
            ("SageMaker MP", is_sagemaker_mp_enabled()),
            ("XLA", is_torch_xla_available()),
        )
        if on
    ]
    if found:
        raise ValueError(
            f"snapstate's Trainer integration does not support {', '.join(found)}: it writes "
            f"its own checkpoints; supported: {SUPPORTED}"
        )


class SnapstateTrainer(SnapstateTrainerMixin, Trainer):
    """``transformers.Trainer`` with snapstate checkpoints: a drop-in replacement."""

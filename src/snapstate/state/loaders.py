"""Data-loader state: torchdata's StatefulDataLoader saved and restored so that a resume is bitwise.

torchdata's own ``state_dict`` is exact for the position in the epoch, but a resume around it
is not, for three reasons this module removes (see tests/determinism/test_plain_loop.py):

* creating an iterator draws: ``randperm`` on the sampler's generator and ``_base_seed`` on
  the loader's generator, or on torch's global generator when the loader has none. The
  uninterrupted run made the current epoch's draws before the checkpoint; a resumed run
  makes them again in its first ``iter(loader)``, after ``RNGState`` was restored.
* torchdata restores the generator to its state at the start of the epoch and replays only
  the permutation, not the ``_base_seed`` draw, so the next epoch is shuffled differently.
* ``load_state_dict`` on a fresh loader would start an iterator just to learn the structure.

So the saved state holds, besides torchdata's dict, the current state of every generator the
loader draws from. After a restore, the loader's next iterator (the user's ``iter(loader)``)
is created with the global generators kept as they were, and then the loader's generators
are set to what they were at the save. Random draws inside worker processes are another matter: see
``snapstate.data.WorkerRNG`` and the warning below.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import Sampler

from snapstate.state.rng import RNGState
from snapstate.state.samplers import ElasticSampler, WorkerRNG

GENERATORS = "snapstate_generators"  # key added to torchdata's state dict
_warned: set[str] = set()


class WorkerRandomnessWarning(UserWarning):
    """Random draws inside data-loader workers may not resume bit for bit."""


def _is_torchdata(obj: Any, name: str) -> bool:
    # By class name and module, so that torchdata is imported only by users who have it.
    return any(
        c.__name__ == name and c.__module__.startswith("torchdata.stateful_dataloader")
        for c in type(obj).__mro__
    )


_PLAIN = (dict, list, tuple, int, float, str, bool, type(None), torch.Tensor)


def is_loader(obj: Any) -> bool:
    """A torchdata StatefulDataLoader (or a subclass)."""
    return type(obj) not in _PLAIN and _is_torchdata(obj, "StatefulDataLoader")


def is_rank_local_sampler(obj: Any) -> bool:
    """A sampler with state that belongs to its rank (position, generator).

    ElasticSampler is not: its state is the job's global position, the same on every rank.
    """
    if type(obj) in _PLAIN or not isinstance(obj, Sampler) or isinstance(obj, ElasticSampler):
        return False
    return callable(getattr(obj, "state_dict", None))


def generators(loader: Any) -> dict[str, torch.Generator]:
    """Every distinct torch.Generator the loader or its samplers draw from, by role."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = {
        "loader": getattr(loader, "generator", None),
        "sampler": getattr(getattr(loader, "sampler", None), "generator", None),
        "batch_sampler": getattr(getattr(batch_sampler, "sampler", None), "generator", None),
    }
    found: dict[str, torch.Generator] = {}
    for role, gen in candidates.items():
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found.values()):
            found[role] = gen
    return found


@contextmanager
def global_rng_kept() -> Iterator[None]:
    """Whatever the body draws from python, numpy and torch's global generators is undone."""
    rng = RNGState()
    saved = rng.state_dict()
    try:
        yield
    finally:
        rng.load_state_dict(saved)


def capture(loader: Any, path: str) -> dict[str, Any]:
    """The loader's state to save: torchdata's dict plus its generators' current states."""
    _warn_about_workers(loader, path)
    with global_rng_kept():  # state_dict() before the first iter() creates the iterator
        state = dict(loader.state_dict())
    state[GENERATORS] = {role: g.get_state() for role, g in generators(loader).items()}
    return state


def restore(loader: Any, state: dict[str, Any]) -> None:
    """Load ``state``; the next iterator the loader creates is the resumed one, drawing nothing."""
    loader.__dict__.pop("_get_iterator", None)  # a restore before this one was not used
    state = dict(state)
    saved_generators = state.pop(GENERATORS, {})
    loader.load_state_dict(state)
    if not state:
        return
    create = loader._get_iterator

    def resumed_iterator() -> Any:
        # Once, at the user's next iter(loader): created then, not now, so that what the loop
        # sets before it (DistributedSampler.set_epoch) is in place, as without snapstate.
        loader.__dict__.pop("_get_iterator", None)
        with global_rng_kept():
            iterator = create()
        current = generators(loader)
        for role, gen_state in saved_generators.items():
            if role in current:
                current[role].set_state(torch.as_tensor(gen_state, dtype=torch.uint8).cpu())
        return iterator

    # An instance attribute: StatefulDataLoader.__iter__ and state_dict() call self._get_iterator().
    loader._get_iterator = resumed_iterator


def restore_template(obj: Any) -> Any:
    """What restore planning matches the checkpoint against (a loader's would start workers)."""
    return {} if is_loader(obj) else obj.state_dict()


def state_of(obj: Any, path: str) -> Any:
    """``obj.state_dict()``, or for a data loader the state :func:`capture` saves."""
    return capture(obj, path) if is_loader(obj) else obj.state_dict()


def load_into(obj: Any, state: Any) -> None:
    """``obj.load_state_dict(state)``, or for a data loader :func:`restore`."""
    if is_loader(obj):
        restore(obj, state)
    else:
        obj.load_state_dict(state)


def _warn_about_workers(loader: Any, path: str) -> None:
    if getattr(loader, "num_workers", 0) == 0 or isinstance(loader.dataset, WorkerRNG):
        return
    if path in _warned:
        return
    _warned.add(path)
    warnings.warn(
        f"data loader {path!r} has num_workers={loader.num_workers}: random draws inside its "
        "workers (augmentation in the dataset's __getitem__) restart from the worker's seed "
        "after a resume, so they are not bit for bit those of an uninterrupted run. Wrap the "
        "dataset: StatefulDataLoader(snapstate.data.WorkerRNG(dataset), ...) keeps each "
        "worker's generators in the loader's state (nothing to do if the dataset draws none).",
        WorkerRandomnessWarning,
        stacklevel=4,
    )

"""ElasticSampler: a distributed sampler whose position is global, so it resumes on any world size.

``DistributedSampler`` deals the epoch's permutation out by rank (``order[rank::world]``),
so its position only means something for one world size: resumed on 3 ranks after 2, it
repeats some samples and skips others. ElasticSampler keeps what is global, the epoch, the
seed and the number of samples the whole job consumed this epoch, and deals out only what
is left. Resumed on any number of ranks it continues the same global order from the same
position, so across restarts every sample of an epoch is used exactly once.

Its state is the same on every rank (it assumes synchronous data parallelism: every rank
takes the same number of samples, the last step of an epoch excepted), so it is saved once,
as plain values. Put it in the checkpointed state as it is::

    sampler = ElasticSampler(dataset, seed=0)  # from snapstate.data import ElasticSampler
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    state = {"model": model, "optim": opt, "sampler": sampler}

The position counts the indices the sampler has handed out. A loader with worker processes
fetches batches ahead of the training loop; then construct it with ``count="manual"`` and
call ``sampler.advance(n)`` with the samples this rank actually trained on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Literal

import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

from snapstate.state.rng import RNGState


class ElasticSampler(Sampler[int]):
    """Samples of one epoch, shuffled by (seed, epoch), dealt round-robin to the ranks that remain."""

    def __init__(
        self,
        dataset: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        count: Literal["yield", "manual"] = "yield",
    ) -> None:
        self.size = dataset if isinstance(dataset, int) else len(dataset)
        self.num_replicas, self.rank = _world(num_replicas, rank)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        self.shuffle, self.seed, self.drop_last, self.count = shuffle, seed, drop_last, count
        self.epoch = 0
        self.consumed = (
            0  # samples of this epoch the whole job had consumed when the current pass began
        )
        self._taken = 0  # indices this rank took since then

    # -- the order ------------------------------------------------------------------
    def order(self, epoch: int) -> list[int]:
        """The epoch's global order: the same on every rank and for every world size."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def _share(self, rank: int, remaining: int) -> int:
        """How many of the ``remaining`` samples ``rank`` takes this pass."""
        if self.drop_last:
            return remaining // self.num_replicas
        return max(0, -(-(remaining - rank) // self.num_replicas))

    def __len__(self) -> int:
        return self._share(self.rank, self.size - self.consumed)

    def __iter__(self) -> Iterator[int]:
        start = self.position
        self.consumed, self._taken = start, 0
        remaining = self.order(self.epoch)[start:]
        mine = remaining[self.rank :: self.num_replicas][: self._share(self.rank, len(remaining))]
        for index in mine:
            if self.count == "yield":
                self._taken += 1
            yield index
        self.set_epoch(self.epoch + 1)  # the epoch is used up; a new pass starts the next one

    # -- the position -----------------------------------------------------------------
    @property
    def position(self) -> int:
        """Samples of this epoch consumed by the whole job (every rank took ``_taken`` or its share)."""
        remaining = self.size - self.consumed
        return self.consumed + sum(
            min(self._taken, self._share(r, remaining)) for r in range(self.num_replicas)
        )

    def advance(self, samples: int) -> None:
        """With ``count="manual"``: this rank trained on ``samples`` more samples."""
        self._taken += samples

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (no-op if it is the current one, so resumes continue)."""
        if epoch != self.epoch:
            self.epoch, self.consumed, self._taken = epoch, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.position,
            "seed": self.seed,
            "size": self.size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["seed"], state["size"], state["shuffle"]) != (self.seed, self.size, self.shuffle):
            raise ValueError(
                f"sampler state is for seed={state['seed']}, size={state['size']}, shuffle={state['shuffle']}; "
                f"this sampler has seed={self.seed}, size={self.size}, shuffle={self.shuffle}"
            )
        self.epoch, self.consumed, self._taken = int(state["epoch"]), int(state["consumed"]), 0


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return (num_replicas if num_replicas is not None else dist.get_world_size()), (
            rank if rank is not None else dist.get_rank()
        )
    return (num_replicas or 1), (rank or 0)


class WorkerRNG(Dataset[Any]):
    """A map-style dataset whose data-loader workers' generators are part of the loader's state.

    Random augmentation inside ``__getitem__`` draws from the worker process's python, numpy
    and torch generators, seeded when the worker starts. After a resume the workers start
    again from that seed, so without this wrapper their draws differ from the uninterrupted
    run's. torchdata's StatefulDataLoader asks a Stateful dataset for its state after every
    batch, in the worker, and restores it in the new worker; this wrapper answers with the
    worker's generators, so each worker continues exactly where it was::

        loader = StatefulDataLoader(WorkerRNG(dataset), num_workers=2, ...)

    The draws are the same as without the wrapper. In the main process (``num_workers=0``)
    it holds nothing: there ``ss.RNGState()`` covers the same generators.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # Attributes the loop reads from the dataset (classes, transform...) stay visible.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        if get_worker_info() is None:
            return {}
        return {"rng": RNGState().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and get_worker_info() is not None:
            RNGState().load_state_dict(state["rng"])

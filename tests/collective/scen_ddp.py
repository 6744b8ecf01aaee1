"""Rank side of the DDP tests: train, save deduplicated, load on any number of ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import snapstate as ss
from support.bits import same_bits

from .common import flat_tensors

CHUNK_BYTES = 32 << 10
OPTIONS = ss.SaveOptions(plan=ss.PlanOptions(chunk_bytes=CHUNK_BYTES), block_bytes=4096)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # identical replicas on every rank, as DDP requires
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 130), nn.ReLU(), nn.Linear(130, 10)
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    ddp = DDP(model)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def live_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return flat_tensors({"model": model.state_dict(), "optim": opt.state_dict()["state"]})


def save(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    model, opt = build()
    train(model, opt, rank, 3)
    state = {"model": model, "optim": opt, "rng": ss.RNGState(), "step": 3}
    rng_at_save = torch.get_rng_state().clone()
    first = ss.save(state, args["path"], options=OPTIONS)
    again = ss.save(state, args["path"] + "-again", options=OPTIONS)
    # structure differs on one rank
    state["extra"] = ss.RankLocal({"only": torch.full((3,), float(rank))}) if rank == 1 else 0
    third = ss.save(state, args["path"] + "-third", options=OPTIONS)
    del state["extra"]
    tensors = live_tensors(model, opt)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, args["reference"])
    # load back on the same ranks, into a fresh model and a fresh optimizer (no state yet)
    torch.rand(5)  # move the RNG on: the load must bring it back
    fresh_model, fresh_opt = build()
    loaded = ss.load(
        {"model": fresh_model, "optim": fresh_opt, "rng": ss.RNGState(), "step": 0},
        args["path"],
        read_once=True,
    )
    fresh = live_tensors(fresh_model, fresh_opt)
    return {
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "bytes_written": first.bytes_written,
        "plan_cached": [
            first.timings["plan_cached"],
            again.timings["plan_cached"],
            third.timings["plan_cached"],
        ],
        "replica_check_s": first.timings["replica_check_s"],
        "same_after_load": sorted(fresh) == sorted(tensors)
        and all(same_bits(fresh[k], tensors[k]) for k in tensors),
        "rng_restored": bool(torch.equal(torch.get_rng_state(), rng_at_save)),
        "bytes_read": loaded.bytes_read,
        "bytes_received": loaded.bytes_received,
    }


def load(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Load on ``world`` ranks (any number) into fresh objects; compare with the reference."""
    reference = load_file(args["reference"])
    out: dict[str, Any] = {}
    try:
        ss.load({"model": build()[0], "rng": ss.RNGState()}, args["path"])
        out["rank_local_error"] = None
    except ss.IncompatibleStateError as exc:
        out["rank_local_error"] = str(exc)
    for read_once in (True, False):
        model, opt = build()
        result = ss.load(
            {"model": model, "optim": opt, "step": 0},
            args["path"],
            rank_local="skip",
            read_once=read_once,
        )
        got = live_tensors(model, opt)
        out[f"read_once={read_once}"] = {
            "equal": sorted(got) == sorted(reference)
            and all(same_bits(got[k], reference[k]) for k in reference),
            "bytes_read": result.bytes_read,
            "bytes_received": result.bytes_received,
        }
        dist.barrier()
    return out


def background_is_collective_free(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Record the thread of every collective during async saves: all must be the caller's."""
    threads: list[str] = []
    patched = {}
    for name in (
        "all_gather_object",
        "all_gather",
        "broadcast",
        "barrier",
        "all_reduce",
        "broadcast_object_list",
    ):
        original = getattr(dist, name)

        def spy(*a: Any, _original: Any = original, **kw: Any) -> Any:
            import threading

            threads.append(threading.current_thread().name)
            return _original(*a, **kw)

        patched[name] = original
        setattr(dist, name, spy)
    try:
        model, opt = build()
        train(model, opt, rank, 1)
        handles = [
            ss.async_save({"model": model, "optim": opt}, f"{args['path']}-{i}") for i in range(3)
        ]
        for h in handles:
            h.wait()
    finally:
        for name, original in patched.items():
            setattr(dist, name, original)
    import threading

    return {
        "threads": sorted(set(threads)),
        "main": threading.current_thread().name,
        "calls": len(threads),
    }


def subgroups(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Two process groups of two ranks each save and load their own checkpoints at once."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    model, opt = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank // 2)  # each group its own values
    path = f"{args['path']}-g{rank // 2}"
    saved = ss.save({"model": model}, path, process_group=mine)
    fresh = build()[0]
    loaded = ss.load({"model": fresh}, path, process_group=mine, read_once=True)
    same = all(
        same_bits(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values())
    )
    dist.barrier()  # rank 0 hosts the store the other group still uses: it stays until both are done
    return {
        "world": saved.world_size,
        "rank": saved.rank,
        "same": same,
        "received": loaded.bytes_received,
    }


def save_full(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """A whole training state, per-rank loader and RNG included, for partial loads elsewhere."""
    from torch.utils.data import DistributedSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    model, opt = build()
    train(model, opt, rank, 2)
    data = TensorDataset(torch.arange(64.0).reshape(32, 2))
    loader = StatefulDataLoader(
        data, batch_size=4, sampler=DistributedSampler(data, num_replicas=world, rank=rank)
    )
    batches = iter(loader)
    for _ in range(rank + 1):  # each rank at its own position
        next(batches)
    state = {"model": model, "optim": opt, "loader": loader, "rng": ss.RNGState(), "step": 2}
    ss.save(state, args["path"], options=OPTIONS)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args["reference"])
    return {"loader_position": loader.state_dict()["_num_yielded"]}

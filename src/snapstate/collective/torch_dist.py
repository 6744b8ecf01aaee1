"""TorchDistCoordinator: collectives on a torch.distributed group, commit traffic on its TCP store.

``all_gather`` runs on the process group and is refused on snapstate's own background
threads: a collective there could interleave with the training loop's collectives and
deadlock (the failure users of other checkpointers report). Everything the background
commit needs goes through the c10d key-value store instead, with short non-blocking
polls (``check``) rather than a blocking ``wait``, on a separate store connection, so a
long wait never holds the connection the main thread uses.
"""

from __future__ import annotations

import pickle
import struct
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from snapstate.collective.key_wait import KeysTimeoutError, Poll
from snapstate.errors import CheckpointTimeoutError

PREFIX = "snapstate"
INLINE_BYTES = 512  # of an object gathered in the first collective (see _gather)
_LENGTH = struct.Struct("<q")
BACKGROUND_THREAD_PREFIX = "snapstate-"

_instances: weakref.WeakKeyDictionary[Any, TorchDistCoordinator] = weakref.WeakKeyDictionary()
_default_instance: list[TorchDistCoordinator] = []


class StoreLostError(CheckpointTimeoutError):
    """The key-value store stopped answering: its host (rank 0 by default) is probably gone."""


class TorchDistCoordinator:
    """Coordinator for one process group; one instance per group, so caches survive saves."""

    def __init__(self, process_group: Any = None) -> None:
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self.backend = str(dist.get_backend(process_group))
        self._store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
        self._owner = threading.get_ident()
        self._background: Any = None
        self._lock = threading.Lock()
        self._world = dist.group.WORLD  # a new init_process_group makes a new one

    @classmethod
    def for_group(cls, process_group: Any = None) -> TorchDistCoordinator:
        if process_group is None or process_group is dist.group.WORLD:
            if not _default_instance or _default_instance[0]._world is not dist.group.WORLD:
                _default_instance[:] = [cls(None)]
            return _default_instance[0]
        coord = _instances.get(process_group)
        if coord is None:
            coord = _instances[process_group] = cls(process_group)
        return coord

    # -- foreground collectives ---------------------------------------------------
    def all_gather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's ``obj``; with ``timeout``, CheckpointTimeoutError once it has passed.

        Without a bound a rank that never joins (stopped, hung) would hold the others for the
        process group's own timeout, 30 minutes by default.
        """
        if threading.current_thread().name.startswith(BACKGROUND_THREAD_PREFIX):
            raise RuntimeError(
                "snapstate never runs a collective on the training process group from a background thread"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return self._gather(obj, deadline)
        except CheckpointTimeoutError:
            raise
        except (dist.DistError, RuntimeError) as exc:
            # gloo: "Connection closed by peer" when a rank died, "timed out" past the bound
            late = deadline is not None and time.monotonic() >= deadline
            why = f"within {timeout:g}s" if late else f"({exc})"
            raise CheckpointTimeoutError(
                f"the other ranks did not all take part in the collective {why}; a rank may have died or stopped"
            ) from exc

    def all_gather_within(self, obj: Any, timeout: float) -> list[Any]:
        return self.all_gather(obj, timeout)

    def _gather(self, obj: Any, deadline: float | None) -> list[Any]:
        """``all_gather_object`` in one collective when every rank's bytes fit ``INLINE_BYTES``.

        The first gather carries each rank's length and its first ``INLINE_BYTES``: a save's
        offer on a cached plan fits, so a steady loop pays one collective per save, not the
        two (sizes, then bytes) of ``all_gather_object``. Longer objects send the rest in a
        second gather, padded to the longest rest.
        """
        device = self._device()
        data = pickle.dumps(obj)
        head = bytearray(_LENGTH.pack(len(data)) + data[:INLINE_BYTES])
        head.extend(bytes(_LENGTH.size + INLINE_BYTES - len(head)))
        mine = torch.frombuffer(head, dtype=torch.uint8).to(device)
        heads = [torch.empty_like(mine) for _ in range(self.world_size)]
        wait_work(dist.all_gather(heads, mine, group=self.group, async_op=True), deadline)
        raw = [h.cpu().numpy().tobytes() for h in heads]
        lengths = [_LENGTH.unpack_from(r)[0] for r in raw]
        parts = [
            r[_LENGTH.size : _LENGTH.size + min(n, INLINE_BYTES)] for r, n in zip(raw, lengths)
        ]
        longest_rest = max(lengths) - INLINE_BYTES
        if longest_rest > 0:
            rest = torch.zeros(longest_rest, dtype=torch.uint8, device=device)
            if len(data) > INLINE_BYTES:
                rest[: len(data) - INLINE_BYTES] = torch.frombuffer(
                    bytearray(data[INLINE_BYTES:]), dtype=torch.uint8
                )
            rests = [torch.empty_like(rest) for _ in range(self.world_size)]
            wait_work(dist.all_gather(rests, rest, group=self.group, async_op=True), deadline)
            for r, (t, n) in enumerate(zip(rests, lengths)):
                if n > INLINE_BYTES:
                    parts[r] += t[: n - INLINE_BYTES].cpu().numpy().tobytes()
        # the process group's own ranks only: what all_gather_object itself unpickles
        return [pickle.loads(p) for p in parts]  # noqa: S301

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- store: safe from any thread ----------------------------------------------
    def publish(self, key: str, value: str) -> None:
        self._call(lambda s: s.set(key, value))

    def await_keys(self, keys: list[str], timeout: float) -> list[str]:
        """Values of ``keys`` once all exist; KeysTimeoutError naming the missing ones otherwise."""
        deadline = time.monotonic() + timeout
        poll = Poll()
        while not self._call(lambda s: s.check(keys)):
            if time.monotonic() >= deadline:
                missing = self.missing(keys)
                if missing:
                    raise KeysTimeoutError(
                        f"timed out after {timeout:g}s waiting for {describe_missing(missing)}",
                        missing,
                    )
                break
            poll.sleep()
        return [v.decode() for v in self._call(lambda s: s.multi_get(keys))]

    def missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self._call(lambda s, k=k: s.check([k]))]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(lambda s: s.add(key, amount)))

    def delete_keys(self, keys: list[str]) -> None:
        for k in keys:
            self._call(lambda s, k=k: s.delete_key(k))

    def _call(self, op: Any) -> Any:
        try:
            if threading.get_ident() == self._owner:
                return op(self._store)
            with self._lock:  # one extra connection serves every background thread, in turn
                if self._background is None:
                    self._background = self._store.clone()  # type: ignore[attr-defined]
                return op(self._background)
        except CheckpointTimeoutError:
            raise
        except (RuntimeError, OSError) as exc:  # DistNetworkError, DistStoreError, reset sockets
            raise StoreLostError(
                f"the torch.distributed store stopped answering ({exc}); its host, usually rank 0, may have died"
            ) from exc


def describe_missing(keys: list[str]) -> str:
    """'rank(s) [1, 3]' when the keys end in a rank number (snapstate's own keys do)."""
    ranks = [k.rsplit("/", 1)[-1] for k in keys]
    if all(r.isdigit() for r in ranks):
        return f"rank(s) {sorted(int(r) for r in ranks)}"
    return str(keys)


def wait_work(work: Any, deadline: float | None) -> None:
    """Wait for an async collective, until ``deadline`` (time.monotonic()) when one is given.

    Past the deadline gloo raises a RuntimeError (torch's DistError derives from it).
    """
    if deadline is None:
        work.wait()
        return
    work.wait(timeout=timedelta(seconds=max(0.001, deadline - time.monotonic())))

"""Simulated ranks in one process: threads that share a store and an all_gather."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from snapstate.collective.coordinator import LocalCoordinator


class SharedStore(LocalCoordinator):
    """The key-value store every simulated rank talks to."""


class World:
    """``n`` ranks; ``run(fn)`` calls ``fn(coord)`` on one thread per rank and returns the results."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.store = SharedStore()
        self._barrier = threading.Barrier(n, timeout=20)
        self._slots: list[Any] = [None] * n

    def coordinator(self, rank: int) -> SimCoordinator:
        return SimCoordinator(self, rank)

    def run(self, fn: Callable[[SimCoordinator], Any]) -> list[Any]:
        with ThreadPoolExecutor(self.n) as pool:
            futures = [pool.submit(fn, self.coordinator(r)) for r in range(self.n)]
            return [f.result(timeout=60) for f in futures]

    def gather(self, rank: int, obj: Any) -> list[Any]:
        self._slots[rank] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return out


class SimCoordinator:
    """A Coordinator for one simulated rank."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.n

    def all_gather(self, obj: Any) -> list[Any]:
        return self.world.gather(self.rank, obj)

    def publish(self, key: str, value: str) -> None:
        self.world.store.publish(key, value)

    def await_keys(self, keys: list[str], timeout: float) -> list[str]:
        return self.world.store.await_keys(keys, timeout)

    def missing(self, keys: list[str]) -> list[str]:
        return self.world.store.missing(keys)

    def add(self, key: str, amount: int) -> int:
        return self.world.store.add(key, amount)

    def delete_keys(self, keys: list[str]) -> None:
        self.world.store.delete_keys(keys)

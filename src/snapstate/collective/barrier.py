"""A barrier on the key-value store, safe off the main thread: the commit of a save.

Every rank ``arrive``s with its outcome ("ok" or an error). The coordinator rank waits for
all arrivals, decides (commit or not) and ``decide``s; the others ``wait_decision``. Each
rank times out on its own clock and names the ranks that never arrived, so a dead rank
costs the others at most ``timeout`` seconds, never a hang. No collective on the training
process group is involved (do not add one: this runs in the background of async saves).
Keys are removed once read: the arrivals by the root after reading them, the decision by
the root once every rank acknowledged it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from snapstate.collective.coordinator import Coordinator
from snapstate.collective.key_wait import KeysTimeoutError, Poll
from snapstate.errors import CheckpointError, CheckpointTimeoutError, ReplicaMismatchError

OK = "ok"
TIMEOUT = "timeout: "
REPLICAS = "replicas: "
ERROR = "error: "


@dataclass
class StoreBarrier:
    coord: Coordinator
    name: str  # unique per use (a save id), so stale keys of another use never match
    root: int = 0  # the deciding rank

    def arrival_keys(self) -> list[str]:
        return [f"{self.name}/arrived/{r}" for r in range(self.coord.world_size)]

    @property
    def decision_key(self) -> str:
        return f"{self.name}/decision"

    def arrive(self, outcome: str = OK) -> None:
        self.coord.publish(self.arrival_keys()[self.coord.rank], outcome)

    def wait_arrivals(self, timeout: float) -> list[str]:
        """Root only: every rank's outcome, or CheckpointTimeoutError naming the absent ranks."""
        keys = self.arrival_keys()
        try:
            outcomes = self.coord.await_keys(keys, timeout)
        except KeysTimeoutError as exc:
            present = [k for k in keys if k not in exc.missing]
            arrived = dict(
                zip((int(k.rsplit("/", 1)[-1]) for k in present), self.coord.await_keys(present, 0))
            )
            raise ArrivalTimeoutError(
                f"{_ranks(exc.missing)} did not arrive within {timeout:g}s; nothing was committed",
                arrived,
            ) from None
        self.coord.delete_keys(keys)
        return outcomes

    def decide(self, outcome: str, arrived: dict[int, str], wait: float) -> None:
        """Publish the decision, then wait (at most ``wait`` s) until the ranks waiting for it read it.

        The wait matters: the root may return and its process exit, taking the store it hosts
        with it, before a slower rank has read the decision. Only ranks that arrived with "ok"
        wait for a decision (a rank that reported a failure has left); the keys are removed
        once every rank has read it.
        """
        if self.coord.world_size == 1:
            return
        self.coord.publish(self.decision_key, outcome)
        waiting = sum(1 for r, o in arrived.items() if r != self.root and o == OK)
        deadline = time.monotonic() + wait
        poll = Poll()
        while self.coord.add(self._ack_key, 0) < waiting and time.monotonic() < deadline:
            poll.sleep()
        if waiting == self.coord.world_size - 1:
            self.coord.delete_keys([self.decision_key, self._ack_key])

    def wait_decision(self, timeout: float) -> str:
        """Non-root ranks: the root's decision; CheckpointTimeoutError naming who is missing."""
        try:
            return self._await_decision(timeout)
        finally:
            try:  # leaving, with the decision or with our own timeout: the root need not wait for us
                self.coord.add(self._ack_key, 1)
            except CheckpointError:  # the store's host is gone; nothing left to tell it
                pass

    def _await_decision(self, timeout: float) -> str:
        try:
            return self.coord.await_keys([self.decision_key], timeout)[0]
        except KeysTimeoutError:
            absent = self.coord.missing(self.arrival_keys())
            if absent:
                raise CheckpointTimeoutError(
                    f"{_ranks(absent)} did not arrive within {timeout:g}s; nothing was committed"
                ) from None
        try:  # everyone arrived: the root is finishing the manifest, give it one more timeout
            return self.coord.await_keys([self.decision_key], timeout)[0]
        except KeysTimeoutError:
            raise CheckpointTimeoutError(
                f"rank {self.root} (the coordinator) did not decide within {2 * timeout:g}s"
            ) from None

    @property
    def _ack_key(self) -> str:
        return f"{self.name}/acks"


class ArrivalTimeoutError(CheckpointTimeoutError):
    """Some ranks did not arrive; ``arrived`` holds the outcomes of those that did."""

    def __init__(self, message: str, arrived: dict[int, str]) -> None:
        super().__init__(message)
        self.arrived = arrived


def raise_for(outcome: str, where: str) -> None:
    """Turn a published decision back into the exception it stands for."""
    if outcome == OK:
        return
    if outcome.startswith(TIMEOUT):
        raise CheckpointTimeoutError(f"{where} was not committed: {outcome.removeprefix(TIMEOUT)}")
    if outcome.startswith(REPLICAS):
        raise ReplicaMismatchError(outcome.removeprefix(REPLICAS))
    raise CheckpointError(f"{where} was not committed: {outcome.removeprefix(ERROR)}")


def describe(exc: BaseException) -> str:
    """The outcome string that stands for ``exc`` (its kind survives the trip through the store)."""
    if isinstance(exc, ReplicaMismatchError):
        return f"{REPLICAS}{exc}"
    prefix = TIMEOUT if isinstance(exc, CheckpointTimeoutError) else ERROR
    return f"{prefix}{type(exc).__name__}: {exc}"


def store_barrier(coord: Coordinator, name: str, timeout: float) -> None:
    """A plain barrier, usable from any thread: returns once every rank arrived."""
    barrier = StoreBarrier(coord, name)
    barrier.arrive()
    if coord.rank == barrier.root:
        try:
            outcomes = dict(enumerate(barrier.wait_arrivals(timeout)))
        except ArrivalTimeoutError as exc:
            barrier.decide(describe(exc), exc.arrived, wait=timeout)
            raise
        failed = [f"rank {r}: {o}" for r, o in outcomes.items() if o != OK]
        decision = OK if not failed else ERROR + "; ".join(failed)
        barrier.decide(decision, outcomes, wait=timeout)
        raise_for(decision, f"barrier {name}")
    else:
        raise_for(barrier.wait_decision(timeout), f"barrier {name}")


def _ranks(keys: list[str]) -> str:
    ranks = sorted(int(k.rsplit("/", 1)[-1]) for k in keys)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"

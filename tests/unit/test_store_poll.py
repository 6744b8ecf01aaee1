"""Waits on the key-value store poll at a tenth of the time waited so far, within bounds."""

from __future__ import annotations

import pytest

from snapstate.collective import key_wait
from snapstate.collective.key_wait import POLL_MAX_S, POLL_MIN_S, Poll


class _Clock:
    """time.monotonic and time.sleep of a clock that only moves when slept on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(key_wait.time, "monotonic", c.monotonic)
    monkeypatch.setattr(key_wait.time, "sleep", c.sleep)
    return c


def wake_after(clock: _Clock, ready_at: float) -> float:
    """How long a poll loop waits for a key that appears ``ready_at`` seconds in."""
    poll = Poll()
    start = clock.now
    while clock.now - start < ready_at:
        poll.sleep()
    return clock.now - start


def test_a_short_wait_is_overslept_by_at_most_a_tenth(clock: _Clock) -> None:
    for ready_at in (0.0003, 0.004, 0.017, 0.25):
        woke = wake_after(clock, ready_at)
        assert woke <= max(ready_at * 1.1, ready_at + POLL_MIN_S) + 1e-9, (ready_at, woke)


def test_pauses_stay_within_bounds_and_grow(clock: _Clock) -> None:
    wake_after(clock, 30.0)
    assert min(clock.pauses) == POLL_MIN_S and max(clock.pauses) == POLL_MAX_S
    assert clock.pauses == sorted(clock.pauses)
    assert len(clock.pauses) < 400  # 30 s of waiting: a few hundred polls, not thousands

"""A fake `time` for the modules under test: `sleep` and `advance` move it, `sleep_until` jumps
to the deadline; nothing really waits (tests order events with events, never wall-clock)."""
from __future__ import annotations


class FakeClock:
    """`monotonic` and `perf_counter` read `now`, which starts at `start`."""

    def __init__(self, start: float = 1000.0):
        self.now = self.start = start

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep_until(self, deadline: float) -> None:
        self.now = max(self.now, deadline)

"""Steady-state seconds per iteration, as a worker measures them.

A worker stamps the end of every iteration (a Local-SGD step with its sync, a pipeline
stage's whole iteration); the period is the median gap between consecutive ends after the
first `WARMUP` iterations (allocator, caches and lazy imports settle over those). This is
what the planners predict, so the flow can put the two side by side.
"""
from __future__ import annotations

import statistics
import time

WARMUP = 2


class IterationClock:
    """End stamps of iterations and their steady-state period."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def tick(self) -> None:
        """One iteration has ended now."""
        self.ends.append(time.perf_counter())

    def period_s(self, warmup: int = WARMUP) -> float:
        """Median seconds between iteration ends after the first `warmup` iterations
        (0.0 when too few iterations ran to give one gap)."""
        gaps = steady_gaps(self.ends, warmup)
        return statistics.median(gaps) if gaps else 0.0


def steady_gaps(ends: list[float], warmup: int = WARMUP) -> list[float]:
    """Seconds between consecutive iteration ends, from the end of iteration `warmup` on."""
    return [b - a for a, b in zip(ends[max(0, warmup - 1):], ends[max(1, warmup):])]

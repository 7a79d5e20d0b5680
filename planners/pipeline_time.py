"""Iteration time of a storage-based pipeline as the executor runs it.

`planners.partition.pipeline_runtime` (the PLANNER_SPEC contract, Hydrozoa App. A) is what
the partition and hybrid solvers optimise: it treats a store hop c = 2 latency + bytes /
bandwidth as one more pipeline stage, so with M micro-batches the hop is paid about M - 1
times, and it scales layer times linearly with the micro-batch. Both assumptions are far
from `engine.pipeline_executor` (20-100 % on the measured benchmarks):

- layer times are affine in the rows, t(n) = fixed + n * per_row, so small micro-batches
  cost more per sample than linear scaling says (the profile may carry the fixed part);
- each stage worker has a compute thread, one upload thread and one download thread that
  prefetches every receive of the iteration at its start. Uploads and downloads overlap
  compute, and a store's hand-off delay (a polling reader noticing a new key) is paid only
  by a reader that is already waiting: once a reader falls behind its writer, the next keys
  are there when it asks. So a long hand-off is paid in the fill and drain (about
  2 (S - 1) times), not once per micro-batch, while put and get times occupy their link
  once per tensor, as the single upload and download threads do.

This module replays the GPipe schedule (`core.schedules.gpipe` + `lower`) on
those three resources per stage (`simulate`, with the hand-off rule above), and derives the steady-state
period: a stage cannot start its next iteration before its uploads have drained and its
optimizer has stepped. Pure python; the contract formula stays the solvers' objective, and
this model predicts the time of the plans they choose.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from core.errors import PlannerInputError
from core.kinds import PipelineSchedule
from core.schedule_costs import Simulation, simulate
from core.schedules import Kind, build_schedule, lower
from core.stage_memory import stage_bounds


@dataclass(frozen=True)
class TransferCosts:
    """What moving one tensor through the store costs, measured per direction."""

    put_latency_s: float
    """Fixed seconds of one put (encode + upload), whatever its size."""
    put_bandwidth: float
    """Bytes per second of a put beyond its latency."""
    get_latency_s: float
    """Fixed seconds of one get (download + decode) of a key that is already there."""
    get_bandwidth: float
    handoff_s: float = 0.0
    """Delay between a put finishing and a reader that is waiting for the key noticing it."""

    def __post_init__(self):
        for name in ("put_latency_s", "get_latency_s", "handoff_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PlannerInputError(name, f"must be a finite number >= 0, got {value!r}")
        for name in ("put_bandwidth", "get_bandwidth"):
            value = getattr(self, name)
            if not value > 0:
                raise PlannerInputError(name, f"must be > 0 bytes/s, got {value!r}")

    def put_s(self, nbytes: float) -> float:
        """Seconds one upload thread spends putting `nbytes`."""
        return self.put_latency_s + nbytes / self.put_bandwidth

    def get_s(self, nbytes: float) -> float:
        """Seconds one download thread spends getting `nbytes` that are already stored."""
        return self.get_latency_s + nbytes / self.get_bandwidth

    @classmethod
    def from_contract(cls, bandwidth: float, latency: float) -> "TransferCosts":
        """The contract's symmetric store (one bandwidth, one latency, no hand-off), for
        callers whose profile has no per-direction probe."""
        return cls(latency, bandwidth, latency, bandwidth, 0.0)


@dataclass(frozen=True)
class PipelineTime:
    """The predicted timing of one pipeline iteration."""

    period_s: float
    """Steady-state seconds per iteration (the slowest stage's cycle)."""
    makespan_s: float
    """First start to last end of one isolated iteration (no optimizer step)."""
    bubble: tuple[float, ...]
    """Per stage, the share of the period its compute thread runs no forward or backward."""
    stage_period_s: tuple[float, ...]
    """Per stage, the shortest cycle it can keep; `period_s` is their maximum."""
    simulation: Simulation
    """The replayed timelines (resources `compute`, `upload`, `download`, `sync`)."""


def stage_times(layers: Sequence[Mapping[str, float]], cuts: Sequence[int], microbatch_size: int,
                profile_batch: int) -> list[dict]:
    """Per stage: forward_s and backward_s at `microbatch_size` rows, out_bytes (the
    activation it sends on) and param_bytes. A cut i splits after layer i.

    Layers are measured at `profile_batch` rows; a layer's optional `forward_fixed_s` /
    `backward_fixed_s` is the per-call part of t(n) = fixed + n * per_row (absent: 0)."""
    if not layers:
        raise PlannerInputError("layers", "needs at least one layer")
    for name, value in (("microbatch_size", microbatch_size), ("profile_batch", profile_batch)):
        if not (isinstance(value, int) and value >= 1):
            raise PlannerInputError(name, f"must be a positive integer, got {value!r}")
    cuts = list(cuts)
    if any(not 0 <= c < len(layers) - 1 for c in cuts) or cuts != sorted(set(cuts)):
        raise PlannerInputError("cuts", f"must increase strictly within 0..{len(layers) - 2}, got {cuts}")
    scale = microbatch_size / profile_batch

    def at_microbatch(layer: Mapping[str, float], key: str) -> float:
        fixed = layer.get(f"{key}_fixed_s", 0.0)
        # a negative intercept (superlinear between the profiled sizes) must not make a
        # small micro-batch's time negative
        return max(0.0, fixed + (layer[f"{key}_s"] - fixed) * scale)

    bounds = stage_bounds([c + 1 for c in cuts], len(layers))  # cut c: after layer c
    return [{"forward_s": sum(at_microbatch(l, "forward") for l in layers[a:b + 1]),
             "backward_s": sum(at_microbatch(l, "backward") for l in layers[a:b + 1]),
             "out_bytes": layers[b]["output_bytes"] * scale,
             "param_bytes": sum(l["param_bytes"] for l in layers[a:b + 1])}
            for a, b in bounds]


def pipeline_iteration(stages: Sequence[Mapping[str, float]], microbatches: int,
                       costs: TransferCosts, *, sync_s: Sequence[float] = (),
                       optimizer_s: Sequence[float] = (), schedule: str = PipelineSchedule.GPIPE,
                       chunks: int = 1) -> PipelineTime:
    """Replay one iteration of `schedule` (`gpipe`, `1f1b`, or `interleaved` with `chunks`
    model stages per worker: worker w holds stages w, w + p, ...) over `stages` (from
    `stage_times`, one per model stage) with `microbatches` micro-batches and return its
    steady-state period. The timelines, cycles and bubbles are per worker.

    Durations: F / B per stage; stage s puts its activation (`out_bytes[s]`) and the
    gradient of its input (`out_bytes[s - 1]`), its neighbours get them; `sync_s[s]` is the
    stage's gradient sync after its last backward (no SYNC when empty). A stage's cycle is
    its first forward to its last action (uploads drained), plus `optimizer_s[s]`, plus the
    get of its first input, which its next iteration cannot start before."""
    n = len(stages)
    if n < 1:
        raise PlannerInputError("stages", "needs at least one stage")
    if not (isinstance(microbatches, int) and microbatches >= 1):
        raise PlannerInputError("microbatches", f"must be a positive integer, got {microbatches!r}")
    for name, values in (("sync_s", sync_s), ("optimizer_s", optimizer_s)):
        if len(values) not in (0, n):
            raise PlannerInputError(name, f"needs one value per stage ({n}) or none, got {len(values)}")
    out = [float(s["out_bytes"]) for s in stages]
    duration = {Kind.F: lambda s: stages[s]["forward_s"], Kind.B: lambda s: stages[s]["backward_s"],
                Kind.SEND_F: lambda s: costs.put_s(out[s]), Kind.SEND_B: lambda s: costs.put_s(out[s - 1]),
                Kind.RECV_F: lambda s: costs.get_s(out[s - 1]), Kind.RECV_B: lambda s: costs.get_s(out[s]),
                Kind.SYNC: lambda s: sync_s[s]}
    if not (isinstance(chunks, int) and chunks >= 1 and n % chunks == 0):
        raise PlannerInputError("chunks", f"must divide the {n} stages, got {chunks!r}")
    workers = n // chunks
    rows = lower(build_schedule(schedule, workers, microbatches, chunks), sync=bool(sync_s))
    sim = simulate(rows, lambda a: float(duration[a.kind](a.stage)), handoff_s=costs.handoff_s,
                   sync_waits_for_uploads=False)

    cycles = []
    for s, row in enumerate(sim.timelines):
        first = min(i.start for i in row if i.action.kind is Kind.F)
        # the next iteration's prefetch starts after the optimizer step, and its first
        # forward needs that download even when the key is long there
        refill = costs.get_s(out[s - 1]) if s > 0 else 0.0  # worker s's first model stage is s
        optimizer = sum(optimizer_s[t] for t in range(s, n, workers)) if optimizer_s else 0.0
        cycles.append(max(i.end for i in row) - first + optimizer + refill)
    period = max(cycles)
    # in the steady state every stage runs at the slowest stage's pace
    busy = [sum(i.end - i.start for i in row if i.action.kind in (Kind.F, Kind.B)) for row in sim.timelines]
    bubble = tuple(1.0 - b / period if period > 0 else 0.0 for b in busy)
    return PipelineTime(period_s=period, makespan_s=sim.makespan, bubble=bubble,
                        stage_period_s=tuple(cycles), simulation=sim)

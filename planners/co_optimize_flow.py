"""The co-optimiser as the flow's plan step uses it: a problem from measured layers and a
target's worker sizes, the exact frontier, and the choice under a budget or a deadline.

Pure and plain data in, plain data out; `coordinator.plan.co_plan` feeds it the profile and turns the
choice into the flow's `core.plan.Plan`.

- `SizeOption`: one worker size the target can launch, with what it changes: the compute
  time factor against the profiled size, the store bandwidth, the price per second.
- `build_problem`: the PLANNER_SPEC `co-optimize` problem (`CoOptProblem`) whose per-layer
  times for size j are the measured times x `time_factor[j]`.
- `frontier`: every Pareto-optimal (iteration time, iteration cost) solution within a worker
  budget (`planners.co_optimize_exact.frontier_exact`, re-scored by `co_optimize.evaluate`).
- `select`: the job's rule over that frontier: under a budget the fastest whose cost fits,
  under a deadline the cheapest whose time fits, else the fastest and, within 5 % of it,
  the cheapest (as `planners.strategy.choose` picks among uniform plans). The frontier is
  exact, so the choice is the optimum of all (cuts, sizes, d) under the same model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from core.outer_sync import wire_bytes
from core.stage_memory import GB
from planners.co_optimize import evaluate
from planners.co_optimize_exact import frontier_exact
from planners.co_optimize_problem import CoOptProblem, CoOptSolution

NEAR_FASTEST = 1.05
"""Within this factor of the fastest iteration, the cheapest wins (no budget or deadline)."""


@dataclass(frozen=True, kw_only=True)
class SizeOption:
    """One worker size of the target and what it changes."""

    memory_gb: float
    vcpu: float
    time_factor: float
    """Compute seconds per second measured at the profiled size (1.0: the same speed)."""
    bandwidth_bytes_per_s: float
    price_per_s: float


@dataclass(frozen=True)
class Point:
    """One solution with its time and cost per iteration under the contract's model."""

    t_iter_s: float
    c_iter: float
    solution: CoOptSolution


def build_problem(layers: Sequence[dict], sizes: Sequence[SizeOption], *, latency_s: float,
                  contention: float, base_memory_bytes: float, optimizer_state_factor: float,
                  microbatches: int, dp_degrees: Sequence[int],
                  sync_bytes_factor: float = 1.0) -> CoOptProblem:
    """The co-optimisation of `layers` (per micro-batch at the profiled size: forward_s,
    backward_s, output_bytes, activation_bytes, param_bytes) over `sizes`. Billing is per
    worker-second of each size (`price_per_s`); the weights are placeholders, `frontier`
    does not use them. `sync_bytes_factor`: bytes a data-parallel sync moves per float32
    parameter byte (the job's sync dtype: `dtype_sync_factor`)."""
    return CoOptProblem(
        forward_s=tuple(tuple(l["forward_s"] * s.time_factor for s in sizes) for l in layers),
        backward_s=tuple(tuple(l["backward_s"] * s.time_factor for s in sizes) for l in layers),
        output_bytes=tuple(float(l["output_bytes"]) for l in layers),
        activation_bytes=tuple(float(l["activation_bytes"]) for l in layers),
        param_bytes=tuple(float(l["param_bytes"]) for l in layers),
        grad_bytes=(0.0,) + tuple(float(l["output_bytes"]) for l in layers[:-1]),
        memory_options_bytes=tuple(s.memory_gb * GB for s in sizes),
        bandwidth_bytes_per_s=tuple(s.bandwidth_bytes_per_s for s in sizes),
        latency_s=latency_s, contention=max(1.0, contention), base_memory_bytes=base_memory_bytes,
        dp_degrees=tuple(dp_degrees), microbatches=microbatches, price_per_byte_s=0.0,
        weights=(1.0, 1.0), price_per_s=tuple(s.price_per_s for s in sizes),
        optimizer_state_factor=optimizer_state_factor, sync_bytes_factor=sync_bytes_factor)


def dtype_sync_factor(param_bytes: float, sync_dtype: str) -> float:
    """Bytes a sync in `sync_dtype` moves per float32 byte of a model of `param_bytes`
    float32 parameter bytes (`core.outer_sync.wire_bytes`; 1.0 for float32 or no parameters)."""
    if param_bytes <= 0:
        return 1.0
    return wire_bytes(param_bytes, sync_dtype) / param_bytes


def only_size(problem: CoOptProblem, j: int) -> CoOptProblem:
    """The same problem with memory option j alone (the uniform plans at that size)."""
    return replace(problem, forward_s=tuple((f[j],) for f in problem.forward_s),
                   backward_s=tuple((b[j],) for b in problem.backward_s),
                   memory_options_bytes=(problem.memory_options_bytes[j],),
                   bandwidth_bytes_per_s=(problem.bandwidth_bytes_per_s[j],),
                   price_per_s=(problem.rates()[j],))


def frontier(problem: CoOptProblem, stages: Callable[[int], tuple[int, int]] | None = None) -> list[Point]:
    """The exact (time, cost) Pareto frontier, fastest first; `stages(d)` gives the fewest and
    the most stages per replica allowed at degree d (a worker budget: d x stages <= workers)."""
    points = []
    for _, _, solution in frontier_exact(problem, stages):
        t_iter, c_iter, _ = evaluate(problem, solution.cuts, solution.d, solution.options)
        points.append(Point(t_iter, c_iter, solution))
    return points


def select(points: Sequence[Point], *, max_cost: float | None = None,
           max_time: float | None = None) -> tuple[Point | None, str]:
    """The job's choice among `points` and the rule that made it (one line).

    `max_cost` (a budget, per iteration): the fastest whose cost is within it; `max_time` (a
    deadline, per iteration): the cheapest whose time is within it (both: the fastest within
    both); neither: the fastest and, within 5 %, the cheapest. When no point meets a limit,
    the cheapest (budget) or the fastest (deadline) is taken and the rule says so."""
    if not points:
        return None, "no solution fits the worker sizes"
    fastest = min(p.t_iter_s for p in points)
    if max_cost is None and max_time is None:
        near = [p for p in points if p.t_iter_s <= fastest * NEAR_FASTEST]
        return min(near, key=lambda p: (p.c_iter, p.t_iter_s)), \
            f"the fastest, and within {NEAR_FASTEST - 1:.0%} of it the cheapest"
    ok = [p for p in points if (max_cost is None or p.c_iter <= max_cost)
          and (max_time is None or p.t_iter_s <= max_time)]
    if max_cost is not None:
        rule = f"the fastest within the budget (${max_cost:.3g} per iteration)"
        if max_time is not None:
            rule += f" and the deadline ({max_time:.3g} s per iteration)"
        if ok:
            return min(ok, key=lambda p: (p.t_iter_s, p.c_iter)), rule
        return min(points, key=lambda p: (p.c_iter, p.t_iter_s)), f"none meets {rule.removeprefix('the fastest within ')}: the cheapest"
    rule = f"the cheapest within the deadline ({max_time:.3g} s per iteration)"
    if ok:
        return min(ok, key=lambda p: (p.c_iter, p.t_iter_s)), rule
    return min(points, key=lambda p: (p.t_iter_s, p.c_iter)), f"none meets the deadline ({max_time:.3g} s per iteration): the fastest"


def describe_point(problem: CoOptProblem, point: Point, steps: int, cuts: Sequence[int] | None = None) -> dict:
    """A point as a row of the report: cuts (in the caller's layers when given), D, stages,
    per-stage GB, its iteration and epoch (`steps` iterations) under the contract's model."""
    s = point.solution
    return {"cuts": list(cuts if cuts is not None else s.cuts), "data_parallel": s.d, "stages": len(s.options),
            "stage_memory_gb": [problem.memory_options_bytes[j] / GB for j in s.options],
            "t_iter_s": point.t_iter_s, "c_iter_usd": point.c_iter,
            "epoch_s": point.t_iter_s * steps, "cost_per_epoch_usd": point.c_iter * steps}

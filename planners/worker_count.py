"""Cynthia's provisioning (Sec. 3-4): the cheapest instance type and worker/PS counts that
reach a target loss before a deadline, under its BSP/ASP performance model.

Model (PLANNER_SPEC.md `provision`), for n_wk workers and n_ps servers of one type with
CPU c and bandwidth b:

    s       BSP: ceil(beta0 / l - beta1); ASP: ceil(beta0 / (l sqrt n_wk) - beta1 / n_wk); >= 1
    demand  r_scale = n_wk c / c_base, c_d = c_prof r_scale, b_d = b_prof r_scale
    supply  c_s = n_ps c, b_s = n_ps b;  u = min(1, c_s / c_d, b_s / b_d)
    BSP     t_iter = max(w_iter / (n_wk c u), 2 g n_wk / b_s)
    ASP     t_iter = w_iter / (c u) + 2 g / b_s
    time = s t_iter, cost = (n_wk + n_ps) price_per_hour / 3600 * time, time <= deadline.

Search. Cynthia scans n_wk between the bounds of Theorem 4.1 with the minimum PS count and
stops at the first feasible count. Once the bottleneck is modelled by demand and supply,
its upper bounds and minimum-PS rule are not valid (the cheapest plan often lies outside
them), so Zooid evaluates every type, every 1 <= n_wk <= max_workers and every
1 <= n_ps <= n_wk with numpy (256 workers: 32,896 pairs per type, about a millisecond).
The only pruning is a bound proven for this model: u <= 1 and t_comm >= 0 give
time >= s(n_wk) w_iter / (n_wk c) (BSP) or s(n_wk) w_iter / c (ASP) whatever n_ps is, so a
worker count whose bound already misses the deadline is skipped with all its PS counts.
(It is Eq. 13's BSP bound evaluated per count; Eq. 13's closed ASP form needs w_iter
restored and l <= sqrt(n_wk), which the per-count form does not.)

How it maps onto Zooid, which has no parameter-server process: the store plays the
parameter server. n_ps is the number of Redis shards or S3 key prefixes the averaging
spreads over; b_ps and c_ps are the store's measured bandwidth and CPU per shard (the
profiler measures them); w_iter and g come from the profiled step, with Local-SGD's period
k dividing the bytes communicated per step (g / k); the loss model (beta0, beta1) is fitted
by `fit_loss_curve` to (iteration, loss) pairs from an earlier run of the same job (jobs
recur) or from a short pilot. The `plan` step and the `deadline` scaling policy call
`plan_provision` that way, the policy with the time and budget that remain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from core.errors import PlannerInputError
from planners import checks as v

MODES = ("BSP", "ASP")
_CHUNK = 1 << 20  # (n_wk, n_ps) pairs evaluated at once


@dataclass(frozen=True, kw_only=True)
class InstanceType:
    """One rentable machine type (workers and servers use the same type)."""

    name: str
    cpu_flops: float
    bandwidth_bytes_per_s: float
    price_per_hour: float


@dataclass(frozen=True, kw_only=True)
class LossModel:
    """Cynthia Eq. 1: loss = beta0 / (s + beta1) (BSP) or beta0 sqrt(n) / (s + beta1) (ASP,
    s counting the iterations of all workers together)."""

    beta0: float
    beta1: float


@dataclass(frozen=True, kw_only=True)
class ProvisionProblem:
    """A provision input (the contract's `provision` document, typed)."""

    mode: str
    w_iter_flops: float
    g_param_bytes: float
    c_prof_flops: float
    b_prof_bytes_per_s: float
    c_base_flops: float
    loss_model: LossModel
    target_loss: float
    deadline_s: float
    instance_types: tuple[InstanceType, ...]
    max_workers: int = 256


@dataclass(frozen=True)
class ProvisionPlan:
    """The cheapest feasible plan."""

    instance_type: str
    workers: int
    parameter_servers: int
    iterations: int
    t_iter_s: float
    time_s: float
    cost: float

    def to_dict(self) -> dict[str, Any]:
        """The contract's JSON form."""
        return {"feasible": True, "instance_type": self.instance_type, "workers": self.workers,
                "parameter_servers": self.parameter_servers, "iterations": self.iterations,
                "t_iter_s": self.t_iter_s, "time_s": self.time_s, "cost": self.cost}


def iterations_needed(problem: ProvisionProblem, workers: np.ndarray | int) -> np.ndarray:
    """s for each worker count (per worker under ASP), at least 1."""
    n = np.asarray(workers, dtype=float)
    b0, b1, target = problem.loss_model.beta0, problem.loss_model.beta1, problem.target_loss
    if problem.mode == "BSP":
        raw = np.full(n.shape, b0 / target - b1)
    else:
        raw = b0 / (target * np.sqrt(n)) - b1 / n
    return np.maximum(1.0, np.ceil(raw))


def iteration_time(problem: ProvisionProblem, kind: InstanceType, workers, servers) -> np.ndarray:
    """t_iter for arrays of (n_wk, n_ps) of one type."""
    n_wk = np.asarray(workers, dtype=float)
    n_ps = np.asarray(servers, dtype=float)
    c, b = kind.cpu_flops, kind.bandwidth_bytes_per_s
    r_scale = n_wk * c / problem.c_base_flops
    c_supply, b_supply = n_ps * c, n_ps * b
    u = np.minimum(1.0, np.minimum(c_supply / (problem.c_prof_flops * r_scale),
                                   b_supply / (problem.b_prof_bytes_per_s * r_scale)))
    if problem.mode == "BSP":
        return np.maximum(problem.w_iter_flops / (n_wk * c * u),
                          2 * problem.g_param_bytes * n_wk / b_supply)
    return problem.w_iter_flops / (c * u) + 2 * problem.g_param_bytes / b_supply


def evaluate(problem: ProvisionProblem, kind: InstanceType, workers: int,
             servers: int) -> ProvisionPlan:
    """The model's numbers for one (type, n_wk, n_ps), feasible or not."""
    s = float(iterations_needed(problem, workers))
    t_iter = float(iteration_time(problem, kind, workers, servers))
    time = s * t_iter
    cost = (workers + servers) * kind.price_per_hour / 3600.0 * time
    return ProvisionPlan(kind.name, workers, servers, int(s), t_iter, time, cost)


def plan_provision(problem: ProvisionProblem) -> ProvisionPlan | None:
    """The least-cost feasible plan over every type and count pair; None when none meets
    the deadline. Ties: less time, then fewer machines, then the earlier type."""
    best_key, best = None, None
    n_all = np.arange(1, problem.max_workers + 1, dtype=float)
    s_all = iterations_needed(problem, n_all)
    for kind in problem.instance_types:
        # proven per-count bound: u <= 1 and t_comm >= 0 (see the module docstring)
        floor = s_all * problem.w_iter_flops / kind.cpu_flops
        if problem.mode == "BSP":
            floor = floor / n_all
        rows = n_all[floor <= problem.deadline_s * (1 + 1e-12)].astype(int)
        for n_wk, n_ps in _pairs(rows):
            s = s_all[n_wk - 1]
            time = s * iteration_time(problem, kind, n_wk, n_ps)
            ok = time <= problem.deadline_s
            if not ok.any():
                continue
            cost = (n_wk + n_ps) * (kind.price_per_hour / 3600.0) * time
            idx = np.flatnonzero(ok)
            i = idx[np.lexsort((n_wk[idx] + n_ps[idx], time[idx], cost[idx]))[0]]
            key = (cost[i], time[i], n_wk[i] + n_ps[i])
            if best_key is None or key < best_key:
                best_key = key
                best = evaluate(problem, kind, int(n_wk[i]), int(n_ps[i]))
    return best


def _pairs(rows: np.ndarray):
    """(n_wk, n_ps) arrays with 1 <= n_ps <= n_wk for the given worker counts, in chunks."""
    start = 0
    while start < len(rows):
        end, total = start, 0
        while end < len(rows) and (total == 0 or total + rows[end] <= _CHUNK):
            total += rows[end]
            end += 1
        block = rows[start:end]
        n_wk = np.repeat(block, block)
        first = np.cumsum(block) - block
        n_ps = np.arange(len(n_wk)) - np.repeat(first, block) + 1
        yield n_wk, n_ps
        start = end


def parse_provision(doc: Any) -> ProvisionProblem:
    """Validate a provision document (PlannerInputError names the field)."""
    if not isinstance(doc, dict):
        raise PlannerInputError("input", "must be a JSON object")
    loss = v.field_value(doc, "loss_model")
    if not isinstance(loss, dict):
        raise PlannerInputError("loss_model", "must be an object {beta0, beta1}")
    kinds = []
    for i, item in enumerate(v.array(doc, "instance_types")):
        path = f"instance_types[{i}]"
        name = v.field_value(item, "name", path)
        if not isinstance(name, str) or not name:
            raise PlannerInputError(f"{path}.name", "must be a non-empty string")
        kinds.append(InstanceType(
            name=name,
            cpu_flops=v.number(item, "cpu_flops", path, positive=True),
            bandwidth_bytes_per_s=v.number(item, "bandwidth_bytes_per_s", path, positive=True),
            price_per_hour=v.number(item, "price_per_hour", path, non_negative=True)))
    return ProvisionProblem(
        mode=v.choice(doc, "mode", MODES),
        w_iter_flops=v.number(doc, "w_iter_flops", positive=True),
        g_param_bytes=v.number(doc, "g_param_bytes", positive=True),
        c_prof_flops=v.number(doc, "c_prof_flops", positive=True),
        b_prof_bytes_per_s=v.number(doc, "b_prof_bytes_per_s", positive=True),
        c_base_flops=v.number(doc, "c_base_flops", positive=True),
        loss_model=LossModel(beta0=v.number(loss, "beta0", "loss_model", positive=True),
                             beta1=v.number(loss, "beta1", "loss_model")),
        target_loss=v.number(doc, "target_loss", positive=True),
        deadline_s=v.number(doc, "deadline_s", positive=True),
        instance_types=tuple(kinds),
        max_workers=v.integer(doc, "max_workers", minimum=1, default=256))


def provision(doc: dict) -> dict:
    """The `provision` command: JSON document in, JSON answer out (see PLANNER_SPEC.md)."""
    problem = parse_provision(doc)
    plan = plan_provision(problem)
    if plan is None:
        return {"feasible": False,
                "reason": (f"no instance type with 1..{problem.max_workers} workers and "
                           f"1..n_wk parameter servers reaches loss {problem.target_loss} "
                           f"within deadline_s {problem.deadline_s}")}
    return plan.to_dict()


# --- the loss curve (Cynthia Eq. 1) ------------------------------------------------------

def fit_loss_curve(points: Iterable[Sequence[float]], *, workers: int = 1) -> LossModel:
    """Least-squares fit of loss = beta0 sqrt(n) / (s + beta1) to (iteration, loss) pairs.

    n = `workers` (1 for BSP; under ASP the iterations count all workers' steps). For a
    fixed beta1 the best beta0 is linear least squares, so the residual is minimised over
    beta1 alone (> -min s, so every denominator stays positive): a log-spaced scan, then a
    golden-section refinement around the best point."""
    data = []
    for i, point in enumerate(points):
        try:
            s, loss = (float(x) for x in point)
        except (TypeError, ValueError):
            raise PlannerInputError(f"points[{i}]", "must be (iteration, loss)") from None
        if not (math.isfinite(s) and math.isfinite(loss)) or s < 0 or loss <= 0:
            raise PlannerInputError(f"points[{i}]", "needs iteration >= 0 and loss > 0")
        data.append((s, loss))
    if workers < 1:
        raise PlannerInputError("workers", f"must be >= 1, got {workers}")
    arr = np.array(data, dtype=float).reshape(-1, 2)
    if np.unique(arr[:, 0]).size < 2:
        raise PlannerInputError("points", "need at least two distinct iteration counts")
    s, loss = arr[:, 0], arr[:, 1]
    low = -float(s.min())
    span = max(1.0, float(s.max()))

    def profile(beta1: float) -> tuple[float, float]:
        x = 1.0 / (s + beta1)
        k = float(loss @ x) / float(x @ x)
        return float(np.sum((loss - k * x) ** 2)), k

    # beta1 = low + exp(z): the scan covers offsets from 1e-9 to 1e6 times the span
    zs = np.linspace(math.log(1e-9 * span), math.log(1e6 * span), 400)
    res = [profile(low + math.exp(z))[0] for z in zs]
    i = int(np.argmin(res))
    a, b = zs[max(0, i - 1)], zs[min(len(zs) - 1, i + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if profile(low + math.exp(c))[0] <= profile(low + math.exp(d))[0]:
            b = d
        else:
            a = c
    beta1 = low + math.exp((a + b) / 2)
    _, k = profile(beta1)
    return LossModel(beta0=k / math.sqrt(workers), beta1=beta1)

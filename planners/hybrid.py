"""Hydrozoa's hybrid D x M strategy selection (Sec. 3.4, Alg. 1), at a fixed global batch.

For B stages and A replicas of the pipeline (A * B <= G workers) each replica pipelines
M = global_batch / (A * microbatch_size) micro-batches (pairs where M is not whole are
skipped, so no strategy wins by silently changing the batch). Stage j's replicas then
synchronise its P_j parameter bytes:

    ring:  T_j = 2 (A - 1) (P_j / (A bandwidth) + alpha P_j / A + beta)
    store: T_j = scatter_reduce or pipelined_scatter_reduce of P_j among A (sync_time.py)
    T(A, B) = min over B-stage partitions of [ runtime(partition, M) + max_j T_j ]

Every T_j is affine and non-decreasing in P_j, so max_j T_j is one more bottleneck term
of the partition problem and the partition is chosen jointly with its synchronisation by
the same exact solver as `partition` (not the fastest pipeline followed by its sync).
The answer is the (A, B) of highest throughput global_batch / T.

`fit_allreduce` learns alpha and beta by least squares from measured (bytes, workers,
seconds) samples of ring allreduces, as Hydrozoa does on dummy data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from core.errors import PlannerInputError
from core.stage_memory import stage_bounds
from planners import checks as v
from planners.bottleneck_partition import MaxTerm, solve_chain
from planners.partition import PartitionProblem, parse_partition, pipeline_runtime, runtime_terms
from planners.sync_time import STORE_ALGORITHMS, ring_allreduce, store_sync

SYNCS = ("ring",) + STORE_ALGORITHMS


@dataclass(frozen=True, kw_only=True)
class HybridProblem:
    """A hybrid input (the contract's `hybrid` document, typed)."""

    pipeline: PartitionProblem
    """Layers (with param_bytes), bandwidth, transport, latency and max_stages."""
    cluster_size: int
    global_batch: int
    microbatch_size: int
    alpha_s_per_byte: float = 0.0
    beta_s: float = 0.0
    sync: str = "ring"


@dataclass(frozen=True)
class HybridCandidate:
    """One (A, B) strategy with its best partition."""

    data_parallel: int
    stages: int
    microbatches: int
    cuts: tuple[int, ...]
    time_s: float
    throughput: float

    def to_dict(self) -> dict[str, Any]:
        """The contract's JSON form."""
        return {"data_parallel": self.data_parallel, "stages": self.stages,
                "microbatches": self.microbatches, "cuts": list(self.cuts),
                "time_s": self.time_s, "throughput": self.throughput}


@dataclass(frozen=True)
class AllreduceFit:
    """Fitted ring-allreduce overheads and the root-mean-square error of the fit."""

    alpha_s_per_byte: float
    beta_s: float
    rmse_s: float


def sync_affine(problem: HybridProblem, replicas: int) -> tuple[float, float]:
    """(scale, offset) with T_j = scale * P_j + offset for `replicas` replicas."""
    a = replicas
    if a <= 1:
        return 0.0, 0.0
    bw, lat = problem.pipeline.bandwidth_bytes_per_s, problem.pipeline.latency_s
    if problem.sync == "ring":
        return (2 * (a - 1) * (1 / bw + problem.alpha_s_per_byte) / a,
                2 * (a - 1) * problem.beta_s)
    if problem.sync == "scatter_reduce":
        return (3 - 2 / a) / bw, 4 * lat
    return 2 / bw, (2 + a) * lat


def stage_sync_s(problem: HybridProblem, param_bytes: float, replicas: int) -> float:
    """T_j for one stage of `param_bytes` among `replicas` (the plain formulas)."""
    p = problem.pipeline
    if problem.sync == "ring":
        return ring_allreduce(param_bytes, replicas, p.bandwidth_bytes_per_s,
                              problem.alpha_s_per_byte, problem.beta_s)
    return store_sync(problem.sync, param_bytes, replicas, p.bandwidth_bytes_per_s, p.latency_s)


def microbatches_per_replica(problem: HybridProblem, replicas: int) -> int | None:
    """M = global_batch / (replicas x microbatch_size): the micro-batches each replica
    pipelines when the micro-batch size is fixed and the global batch is shared by
    `replicas`; None when that is not a whole number.

    Not `planners.strategy.job_microbatches`, which chooses the count for one replica's
    batch (the job's request, else a small divisor) before any micro-batch size exists;
    this derives it from a fixed size, for every replica count the search tries."""
    per_replica = problem.microbatch_size * replicas
    if problem.global_batch % per_replica:
        return None
    return problem.global_batch // per_replica


def hybrid_time(problem: HybridProblem, replicas: int, cuts: Sequence[int]) -> float:
    """T for one strategy and partition: pipeline runtime plus the slowest stage's sync."""
    m = microbatches_per_replica(problem, replicas)
    if m is None:
        raise ValueError(f"data_parallel: {replicas} replicas do not split the global batch")
    params = [layer.param_bytes for layer in problem.pipeline.layers]
    sync = max(stage_sync_s(problem, sum(params[a:b + 1]), replicas)
               for a, b in stage_bounds([c + 1 for c in cuts], len(params)))  # cut c: after layer c
    return pipeline_runtime(problem.pipeline, cuts, m) + sync


def plan_hybrid(problem: HybridProblem) -> list[HybridCandidate]:
    """Every valid (A, B) with its jointly optimal partition, ordered by A then B."""
    pipe = problem.pipeline
    n_layers = len(pipe.layers)
    params = np.array([layer.param_bytes for layer in pipe.layers], dtype=float)
    out = []
    for a in range(1, problem.cluster_size + 1):
        m = microbatches_per_replica(problem, a)
        top = min(problem.cluster_size // a, n_layers, pipe.max_stages)
        if m is None or top < 1:
            continue
        parts = runtime_terms(pipe, m)
        scale, offset = sync_affine(problem, a)
        terms = parts["terms"] + ([MaxTerm(1.0, params, False, scale, offset)] if a > 1 else [])
        found = solve_chain(cut_values=parts["cut_values"], comm_weight=parts["comm_weight"],
                            terms=terms, max_stages=top)
        for b, sol in sorted(found.items()):
            t = hybrid_time(problem, a, sol.cuts)
            out.append(HybridCandidate(a, b, m, sol.cuts, t,
                                       problem.global_batch / t if t > 0 else math.inf))
    return out


def best_candidate(candidates: Iterable[HybridCandidate]) -> HybridCandidate:
    """Highest throughput; ties go to fewer workers, then fewer stages."""
    return min(candidates, key=lambda c: (c.time_s, c.data_parallel * c.stages, c.stages))


def parse_hybrid(doc: Any) -> HybridProblem:
    """Validate a hybrid document into a `HybridProblem` (PlannerInputError names the field)."""
    pipe = parse_partition(doc, need_microbatches=False, need_params=True)
    sync = v.choice(doc, "sync", SYNCS, default="ring")
    alpha = beta = 0.0
    if sync == "ring":
        ar = v.field_value(doc, "allreduce")
        if not isinstance(ar, dict):
            raise PlannerInputError("allreduce", "must be an object {alpha_s_per_byte, beta_s}")
        alpha = v.number(ar, "alpha_s_per_byte", "allreduce", non_negative=True)
        beta = v.number(ar, "beta_s", "allreduce", non_negative=True)
    return HybridProblem(pipeline=pipe,
                         cluster_size=v.integer(doc, "cluster_size", minimum=1),
                         global_batch=v.integer(doc, "global_batch", minimum=1),
                         microbatch_size=v.integer(doc, "microbatch_size", minimum=1),
                         alpha_s_per_byte=alpha, beta_s=beta, sync=sync)


def hybrid(doc: dict) -> dict:
    """The `hybrid` command: JSON document in, JSON answer out (see PLANNER_SPEC.md)."""
    problem = parse_hybrid(doc)
    candidates = plan_hybrid(problem)
    if not candidates:
        return {"feasible": False,
                "reason": (f"no data-parallel degree A <= cluster_size {problem.cluster_size} "
                           f"makes global_batch {problem.global_batch} / (A * microbatch_size "
                           f"{problem.microbatch_size}) a whole number of micro-batches")}
    best = best_candidate(candidates)
    return {"feasible": True, **best.to_dict(),
            "candidates": [c.to_dict() for c in candidates]}


def fit_allreduce(samples: Iterable[Sequence[float]],
                  bandwidth_bytes_per_s: float = math.inf) -> AllreduceFit:
    """Least-squares alpha, beta >= 0 from measured (bytes, workers, seconds) allreduces.

    The model is `ring_allreduce`; with `bandwidth_bytes_per_s` known, the transfer part is
    subtracted first; left infinite, alpha absorbs it (the two are not separable: both
    multiply P / A). Needs samples with workers >= 2 at two or more bytes-per-worker."""
    rows = []
    for i, sample in enumerate(samples):
        try:
            nbytes, workers, seconds = (float(x) for x in sample)
        except (TypeError, ValueError):
            raise PlannerInputError(f"samples[{i}]", "must be (bytes, workers, seconds)") from None
        if not all(math.isfinite(x) for x in (nbytes, workers, seconds)) or nbytes < 0 \
                or workers < 1 or seconds < 0:
            raise PlannerInputError(f"samples[{i}]", "needs bytes >= 0, workers >= 1, seconds >= 0")
        rows.append((nbytes, workers, seconds))
    if not bandwidth_bytes_per_s > 0:
        raise PlannerInputError("bandwidth_bytes_per_s", "must be > 0")
    data = np.array(rows, dtype=float).reshape(-1, 3)
    p, a, y = data[:, 0], data[:, 1], data[:, 2]
    x1 = 2 * (a - 1) * p / a  # multiplies alpha
    x2 = 2 * (a - 1)          # multiplies beta
    y = y - x1 / bandwidth_bytes_per_s
    multi = a >= 2
    if np.unique(p[multi] / a[multi]).size < 2:
        raise PlannerInputError("samples", "need workers >= 2 at two or more bytes-per-worker sizes")
    x = np.stack([x1, x2], axis=1)
    alpha, beta = _nonnegative_lstsq(x, y)
    rmse = float(np.sqrt(np.mean((x @ np.array([alpha, beta]) - y) ** 2)))
    return AllreduceFit(alpha, beta, rmse)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """min ||x c - y|| over c >= 0 for two columns: the optimum lies on one of the faces
    (interior, c1 = 0, c2 = 0, both 0), so compare the feasible face solutions."""
    options = [np.zeros(2)]
    full = np.linalg.lstsq(x, y, rcond=None)[0]
    if np.all(full >= 0):
        options.append(full)
    for k in range(2):
        col = x[:, k]
        denom = float(col @ col)
        if denom > 0:
            c = np.zeros(2)
            c[k] = max(0.0, float(col @ y) / denom)
            options.append(c)
    best = min(options, key=lambda c: float(np.sum((x @ c - y) ** 2)))
    return float(best[0]), float(best[1])

"""Choose among Local-SGD, pipeline and hybrid D x M for a job, from measured numbers.

The inputs are plain numbers (the profile's per-layer times and sizes, the store's bandwidth
and latency, the worker's price), so this is pure and testable without torch or Prefect.

- Local-SGD with D = `workers` replicas: a step is one replica's forward/backward at the
  job's batch, plus the store allreduce (scatter-reduce) of the parameters and optimizer state
  every k steps, amortised over the k steps.
- Pipeline / hybrid with D replicas of an M-stage pipeline: the iteration time of
  `planners.hybrid` (Hydrozoa's pipeline runtime with store transport, plus the pipelined
  scatter-reduce of each stage's gradients among its D replicas, chosen jointly with the
  partition), at the same per-replica batch split into `microbatches` micro-batches.

Every candidate gets a predicted iteration time, epoch time, cost per epoch and throughput
per dollar; `auto` picks the cheapest epoch among the fastest (throughput within 5 % of the
best), so it never pays much more for a marginal speed-up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planners.hybrid import hybrid
from planners.plan import Plan, plan_local_sgd

STRATEGIES = ("local_sgd", "pipeline", "hybrid")


@dataclass(frozen=True, kw_only=True)
class StrategyInputs:
    """What the planner needs to know about a job, its profile and its target."""

    layers: tuple[dict, ...]
    """Per layer at `profile_batch` samples: forward_s, backward_s, output_bytes, param_bytes."""
    profile_batch: int
    step_s: float
    """One Local-SGD step at `batch_size` samples."""
    param_bytes: float
    optimizer_copies: int
    n_train: int
    batch_size: int
    """Samples per step per replica (split into micro-batches by a pipeline)."""
    workers: int
    stages: int | None
    microbatches: int | None
    sync_period: int | None
    bandwidth: float
    latency: float
    offer: str
    price_per_worker_s: float
    worker_vcpu: float = 1.0
    worker_memory_gb: float = 2.0
    worker_gpu: int = 0


def local_sgd(x: StrategyInputs, workers: int | None = None) -> Plan:
    """The Local-SGD plan for `workers` (default: the job's) replicas."""
    return plan_local_sgd(
        workers=workers or x.workers, train_samples=x.n_train, batch_size=x.batch_size,
        sync_period=x.sync_period, step_s=x.step_s,
        sync_bytes=x.param_bytes * (1 + x.optimizer_copies), bandwidth=x.bandwidth,
        latency=x.latency, worker_vcpu=x.worker_vcpu, worker_memory_gb=x.worker_memory_gb,
        worker_gpu=x.worker_gpu, offer=x.offer, price_per_worker_s=x.price_per_worker_s)


def _microbatch_layers(x: StrategyInputs, microbatch_size: int) -> list[dict]:
    scale = microbatch_size / x.profile_batch
    return [{"forward_s": l["forward_s"] * scale, "backward_s": l["backward_s"] * scale,
             "output_bytes": l["output_bytes"] * scale, "param_bytes": l["param_bytes"]}
            for l in x.layers]


def pipeline_plans(x: StrategyInputs, replicas: int, stages: int | None,
                   microbatches: int) -> list[Plan]:
    """Plans of D = `replicas` pipelines of `stages` stages (every stage count up to the layer
    count when None), each splitting the batch into `microbatches` micro-batches."""
    if not x.layers or x.batch_size % microbatches:
        return []
    mb_size = x.batch_size // microbatches
    doc = {"layers": _microbatch_layers(x, mb_size), "bandwidth_bytes_per_s": x.bandwidth,
           "latency_s": x.latency, "transport": "store", "microbatches": microbatches,
           "max_stages": stages or len(x.layers), "cluster_size": replicas * (stages or len(x.layers)),
           "global_batch": replicas * x.batch_size, "microbatch_size": mb_size,
           "allreduce": {"alpha_s_per_byte": 0.0, "beta_s": 0.0}, "sync": "pipelined_scatter_reduce"}
    answer = hybrid(doc)
    if not answer.get("feasible"):
        return []
    steps = math.ceil(x.n_train / (replicas * x.batch_size))
    plans = []
    for c in answer["candidates"]:
        if c["data_parallel"] != replicas or c["stages"] < 2 or (stages and c["stages"] != stages):
            continue
        epoch_s = steps * c["time_s"]
        n = replicas * c["stages"]
        plans.append(Plan(strategy="hybrid" if replicas > 1 else "pipeline", data_parallel=replicas,
                          stages=c["stages"], cuts=tuple(c["cuts"]), microbatches=microbatches,
                          sync_period=1, steps_per_epoch=steps, batch_size=x.batch_size,
                          worker_vcpu=x.worker_vcpu, worker_memory_gb=x.worker_memory_gb,
                          worker_gpu=x.worker_gpu, offer=x.offer,
                          price_per_worker_s=x.price_per_worker_s,
                          predicted_iteration_s=c["time_s"], predicted_epoch_s=epoch_s,
                          predicted_cost_per_epoch_usd=epoch_s * n * x.price_per_worker_s))
    return plans


def describe(plan: Plan, chosen: bool = False) -> dict:
    """A plan as one row of the alternatives table."""
    per_epoch = plan.predicted_cost_per_epoch_usd
    samples = plan.steps_per_epoch * plan.batch_size * plan.data_parallel
    return {"strategy": plan.strategy, "data_parallel": plan.data_parallel, "stages": plan.stages,
            "workers": plan.workers, "cuts": list(plan.cuts), "microbatches": plan.microbatches,
            "predicted_iteration_s": plan.predicted_iteration_s,
            "predicted_epoch_s": plan.predicted_epoch_s,
            "predicted_cost_per_epoch_usd": per_epoch,
            "throughput_per_dollar": (samples / plan.predicted_epoch_s) / (per_epoch / plan.predicted_epoch_s * 3600)
            if per_epoch > 0 and plan.predicted_epoch_s > 0 else None,
            "chosen": chosen}


def choose(x: StrategyInputs, strategy: str) -> Plan:
    """The plan for `strategy` (`auto` compares all), with the alternatives considered."""
    mb = x.microbatches or next((m for m in (4, 2, 1) if x.batch_size % m == 0), 1)
    candidates: list[Plan] = [local_sgd(x)]
    candidates += pipeline_plans(x, 1, x.stages, mb)
    candidates += pipeline_plans(x, x.workers, x.stages, mb) if x.workers > 1 else []
    wanted = [p for p in candidates if strategy == "auto" or p.strategy == strategy]
    if not wanted:
        raise ValueError(f"strategy: no feasible {strategy} plan (the model needs top-level layers "
                         f"to split, and batch_size {x.batch_size} must divide into {mb} micro-batches)")
    def throughput(p: Plan) -> float:
        return p.data_parallel * p.batch_size / max(p.predicted_iteration_s, 1e-12)

    best_throughput = max(throughput(p) for p in wanted)
    near = [p for p in wanted if throughput(p) >= best_throughput / 1.05]
    best = min(near, key=lambda p: (p.predicted_cost_per_epoch_usd, p.predicted_iteration_s))
    alternatives = tuple(describe(p, p is best) for p in candidates)
    return replace(best, alternatives=alternatives)

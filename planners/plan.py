"""A plan is data: the strategy, the degrees of parallelism, worker sizes and predictions.

`plan_local_sgd` builds the Local-SGD plan from a handful of measured numbers (one step's
compute time, the parameter bytes, the store's bandwidth and latency); the pipeline and
hybrid planners (`partition`, `hybrid`, `co_optimize`) feed the same `Plan` type.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from planners.sync_time import scatter_reduce


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the coordinator provisions and runs for one epoch."""

    strategy: str
    """`local_sgd`, `pipeline` or `hybrid`."""
    data_parallel: int
    """D: replicas."""
    stages: int = 1
    """M: pipeline stages per replica."""
    cuts: tuple[int, ...] = ()
    microbatches: int = 1
    pipeline_schedule: str = "gpipe"
    """The pipeline's schedule (`training.pipeline_schedule.build_schedule`): `gpipe`, `1f1b`
    or `interleaved`."""
    chunks: int = 1
    """v, model stages per stage worker: 1, or >= 2 for `interleaved`, whose `cuts` then cut
    the model into `stages` x v model stages, worker w holding stages w, w + stages, ..."""
    sync_period: int | None = None
    """Local-SGD period k in steps (None: once per epoch)."""
    steps_per_epoch: int = 0
    """Optimizer steps each replica takes per epoch."""
    batch_size: int = 0
    """Samples per step per replica."""
    worker_vcpu: float = 1.0
    worker_memory_gb: float = 2.0
    worker_gpu: int = 0
    offer: str = ""
    price_per_worker_s: float = 0.0
    predicted_iteration_s: float = 0.0
    """Predicted seconds per optimizer step, synchronisation amortised."""
    predicted_epoch_s: float = 0.0
    """A steady-state epoch's wall time: the workers' compute and sync, plus the run's
    per-epoch overhead once `planners.run_prediction` added it."""
    predicted_cost_per_epoch_usd: float = 0.0
    predicted_compute_epoch_s: float = 0.0
    """The workers' part of an epoch: steps x iteration (what the strategy planners predict)."""
    predicted_compute_s: float = 0.0
    """The busiest worker's compute per iteration, the rest of `predicted_iteration_s` being
    communication (transfers, sync): the split the first epoch's measurements calibrate."""
    predicted_first_epoch_s: float = 0.0
    predicted_run_s: float = 0.0
    """From the plan to the run's end, start-up, gaps and teardown included."""
    predicted_run_cost_usd: float = 0.0
    """The whole run's bill (workers, start-up, idle and the coordinator), made at the plan."""
    run_terms: dict = field(default_factory=dict)
    """The `planners.run_prediction.RunTerms` the run predictions used."""
    planner_objective_s: float = 0.0
    """The contract formula's iteration time the partition solver minimised (pipelines; 0
    where no solver ran), kept beside the prediction for the report."""
    alternatives: tuple[dict, ...] = field(default_factory=tuple)
    """Other plans considered, each with its predicted iteration time and cost."""

    @property
    def workers(self) -> int:
        """Worker processes per epoch (D x M)."""
        return self.data_parallel * self.stages

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["workers"] = self.workers
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["cuts"] = tuple(kw.get("cuts", ()))
        kw["alternatives"] = tuple(kw.get("alternatives", ()))
        return cls(**kw)


def plan_local_sgd(*, workers: int, train_samples: int, batch_size: int, sync_period: int | None,
                   step_s: float, sync_bytes: float, bandwidth: float, latency: float,
                   worker_vcpu: float, worker_memory_gb: float, worker_gpu: int,
                   offer: str, price_per_worker_s: float, checkpoint_s: float | None = None) -> Plan:
    """The Local-SGD plan for `workers` replicas and its predicted step time and epoch cost.

    Each replica takes ceil(samples / (workers * batch)) steps, and averages
    `sync_bytes` every `sync_period` steps (once per epoch when None); each sync also writes
    the sync checkpoint (`sync_bytes` once): `checkpoint_s` seconds when measured, else
    one put at `bandwidth` and `latency`."""
    if workers < 1:
        raise ValueError(f"workers: must be >= 1, got {workers}")
    steps = max(1, math.ceil(train_samples / (workers * batch_size)))
    syncs = 1 if sync_period is None else math.ceil(steps / sync_period)
    # the decentralised average is a scatter-reduce then all-gather (FuncPipe Eq. 1), and at
    # every sync rank 0 writes the averaged state as the sync checkpoint (one put) before the
    # next round can complete
    if checkpoint_s is None:
        checkpoint_s = sync_bytes / bandwidth + latency
    sync_s = (scatter_reduce(sync_bytes, workers, bandwidth, latency) + checkpoint_s) * syncs
    epoch_s = steps * step_s + sync_s
    return Plan(strategy="local_sgd", data_parallel=workers, sync_period=sync_period,
                steps_per_epoch=steps, batch_size=batch_size, worker_vcpu=worker_vcpu,
                worker_memory_gb=worker_memory_gb, worker_gpu=worker_gpu, offer=offer,
                price_per_worker_s=price_per_worker_s,
                predicted_iteration_s=epoch_s / steps, predicted_epoch_s=epoch_s,
                predicted_compute_epoch_s=epoch_s, predicted_compute_s=step_s,
                predicted_cost_per_epoch_usd=epoch_s * workers * price_per_worker_s)

"""A plan is data: the strategy, the degrees of parallelism, worker sizes and predictions.

Every planner (`planners.strategy` for Local-SGD, `partition`, `hybrid`; `co_optimize`'s
`CoOptSolution` through `coordinator.plan.co_plan`) ends in this one `Plan`; the coordinator runs it and
the report shows it. Per-stage worker sizes (the co-optimiser's) travel in `stage_memory_gb`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from core.kinds import PipelineSchedule


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
    pipeline_schedule: str = PipelineSchedule.GPIPE
    """The pipeline's schedule (`core.schedules.build_schedule`): `gpipe`, `1f1b`
    or `interleaved`."""
    chunks: int = 1
    """v, model stages per stage worker: 1, or >= 2 for `interleaved`, whose `cuts` then cut
    the model into `stages` x v model stages, worker w holding stages w, w + stages, ..."""
    sync_period: int | None = None
    """Local-SGD period k in steps (None: once per epoch)."""
    outer_optimizer: str = "average"
    """A Local-SGD round's outer step (`core.outer_sync`): `average` (K-AVG) or `nesterov` (DiLoCo)."""
    sync_dtype: str = "float32"
    """What the data-parallel syncs move: `float32`, `bfloat16` or `int8`."""
    collective: str = "store"
    """How the replicas average (Local-SGD's rounds, a hybrid's gradient syncs): `store` (the
    store collectives) or `ring` (a direct ring between the workers); the job's `collective`,
    or the planner's choice under `auto` (`planners.strategy.candidates`)."""
    collective_note: str = ""
    """Under `collective=auto`, why the planner did not compare the ring (it may not run there,
    `coordinator.run.collective.ring_refusal`); empty when it did, or the job named one."""
    sync_checkpoint_s: float = 0.0
    """A Local-SGD sync over the store: seconds between rank 0's sync checkpoints
    (`planners.checkpoint_cadence`; the epoch's last round always; a compressed sync's workers
    get the rounds it holds at the plan's pace, `rounds_between_checkpoints`); 0: every round."""
    sync_bytes: float = 0.0
    """Bytes of the state one data-parallel sync reduces, as they travel in `sync_dtype`
    (Local-SGD: parameters and optimizer state; hybrid: every stage's gradients); 0: unknown."""
    steps_per_epoch: int = 0
    """Optimizer steps each replica takes per epoch."""
    batch_size: int = 0
    """Samples per step per replica."""
    worker_vcpu: float = 1.0
    worker_memory_gb: float = 2.0
    """The size every worker is launched with; with per-stage sizes the largest of them (a
    stage's worker gets its own, `memory_gb_of`)."""
    worker_gpu: int = 0
    stage_memory_gb: tuple[float, ...] = ()
    """Memory chosen for each pipeline stage (GB, one per stage) by the co-optimiser; empty:
    every stage is `worker_memory_gb`."""
    offer: str = ""
    price_per_worker_s: float = 0.0
    capacity: str = "on_demand"
    """The capacity the workers rent (`core.kinds.Capacity`: `on_demand` or `spot`, never
    `auto`); `price_per_worker_s` is that capacity's price."""
    capacity_choice: dict = field(default_factory=dict)
    """Both capacities' predicted worker bills and the expected preemptions
    (`planners.spot.CapacityChoice`); empty where the target has no spot offer."""
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
    """The whole run's bill (workers, start-up, idle, the coordinator and the store), made at the plan."""
    predicted_store_usd: float = 0.0
    """The store's part of `predicted_run_cost_usd`: its requests (those billed by the plan, the
    profile's; `predicted_store_ops` each epoch with its warm channel; the run's own requests an
    earlier run on the target measured: staging, each epoch's bookkeeping, teardown, all priced by
    the stores' offers) and its server (a cloud Redis) for the run."""
    predicted_store_ops: dict = field(default_factory=dict)
    """One epoch's store requests by kind (`planners.store_requests.epoch_store_ops`)."""
    predicted_cost_by_epoch_usd: tuple[float, ...] = ()
    """The bill predicted at the end of each epoch from the plan on (the ledger before it
    included): what the coordinator's per-epoch line holds the bill so far against."""
    predicted_workers_by_epoch: tuple[int, ...] = ()
    """Workers of each epoch to come where the job's scaling policy decides them in advance and
    changes them (adabatch); empty: the plan's workers throughout."""
    run_terms: dict = field(default_factory=dict)
    """The `planners.run_prediction.RunTerms` the run predictions used."""
    planner_objective_s: float = 0.0
    """The contract formula's iteration time the partition solver minimised (pipelines; 0
    where no solver ran), kept beside the prediction for the report."""
    alternatives: tuple[dict, ...] = field(default_factory=tuple)
    """Other plans considered, each with its predicted iteration time and cost."""
    co_optimizer: dict = field(default_factory=dict)
    """Whether the co-optimiser chose this plan (`used`), and why not, or what it compared:
    the sizes considered, the uniform plan, the co-optimised one, the frontier."""

    @property
    def workers(self) -> int:
        """Worker processes per epoch (D x M)."""
        return self.data_parallel * self.stages

    def memory_gb_of(self, rank: int) -> float:
        """The memory worker `rank` is launched with: its stage's size (rank r * stages + s is
        stage s of replica r) where the co-optimiser chose per-stage sizes, else the plan's."""
        if self.stage_memory_gb:
            return self.stage_memory_gb[rank % self.stages]
        return self.worker_memory_gb

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
        kw["stage_memory_gb"] = tuple(float(g) for g in kw.get("stage_memory_gb") or ())
        kw["predicted_cost_by_epoch_usd"] = tuple(kw.get("predicted_cost_by_epoch_usd") or ())
        kw["predicted_workers_by_epoch"] = tuple(kw.get("predicted_workers_by_epoch") or ())
        return cls(**kw)

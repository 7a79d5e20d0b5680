"""The coordinator's state for one run, shared by its tasks and its failure hooks.

Tasks run in the coordinator's process and share one `RunContext`: the run id and the
resolved job, immutable once validated, and a `RunState` holding what the run changes (the
ledger so far, the launchers whose workers may still be running, attempt numbers). The
flow's hooks find the context of a crashed or cancelled run through `ACTIVE`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from blocks.store_refs import open_store_ref
from comm.store_base import process_ops
from comm.store_dir import zooid_home
from coordinator.run.job import TrainJob
from coordinator.run.validate import ResolvedJob
from core.cost_record import CostRecord
from core.errors import ZooidValueError
from core.kinds import Capacity

RUN_PREFIX = "z"


def run_id_for(flow_run_id) -> str:
    """The run id of a coordinator flow run: short, stable, and derivable by a hook."""
    return RUN_PREFIX + str(flow_run_id).replace("-", "")[:12]


ACTIVE: dict[str, "RunContext"] = {}
"""The one registry: contexts of runs in progress in this process, by flow run id. Only the
flow's failure hooks read it (`flows.hooks.on_abnormal_end`): Prefect calls a hook with the
flow run alone, so this is how a hook in the coordinator's process finds the run's workers
and ledger. `flows.train.run_training` adds its context and removes it when the run ends."""


@dataclass
class RunState:
    """What one run changes as it goes: the bill so far, the workers it started, attempt
    numbers, what it measured. Owned by the run's `RunContext` and changed only by its steps."""

    ledger: list[CostRecord] = field(default_factory=list)
    launchers: list[Any] = field(default_factory=list)
    """Launchers whose workers may still be running (teardown stops them)."""
    prestarted: dict = field(default_factory=dict)
    """Epoch -> launcher whose workers were started during the previous epoch."""
    startup_samples: list = field(default_factory=list)
    """Measured worker start-up latencies (launch to work), seconds."""
    dispatch_samples: list = field(default_factory=list)
    """A command's round trip to a ready worker and back through the store, less the worker's
    own busy time (the profile's commands measure it), seconds."""
    last_epoch_s: float = 0.0
    last_epoch_end: float | None = None
    cloud_attempts: dict = field(default_factory=dict)
    """Worker flow run id -> (epoch, rank, attempt), to match cloud intervals to attempts."""
    asked_to_stop: set = field(default_factory=set)
    """Flow run ids of warm workers the coordinator told to stop with their work done (a rescale,
    the teardown): the cloud's clock bills each as a worker that completed, even where it did not
    exit in time and its container was stopped (a non-zero exit)."""
    attempts: dict = field(default_factory=dict)
    """Last attempt number per (epoch, rank)."""
    dataset: dict = field(default_factory=dict)
    """The published dataset's manifest."""
    checkpoint_keys: set | None = None
    """The run's checkpoint keys as the last pruning left them (`coordinator.workers.retention`);
    None until this coordinator's first listing."""
    profile: dict = field(default_factory=dict)
    """The measured profile (peak memory sizes cloud workers)."""
    warm: Any = None
    """The run's warm workers (`coordinator.workers.warm_pool.WarmPool`) when the job keeps them."""
    progress_id: Any = None
    """The run's progress artifact."""
    pool_env: dict | None = None
    """The target pool's default worker environment, read from the API once per run."""
    forks: Any = None
    """The run's fork server of inline workers (`coordinator.workers.worker_forks.WorkerForks`)."""
    store_ops: dict = field(default_factory=dict)
    """The store requests the run's workers reported so far, by store (`core.store_ops`
    groups; `coordinator.workers.epoch_run.counted`)."""
    process_ops_at_start: dict = field(default_factory=process_ops)
    """This process's store requests when the run began: the coordinator's share of the
    run's requests is what the process made since (`coordinator.bill.ledger`)."""
    provisioned: bool = False
    torn_down: bool = False
    cost_recorded: bool = False


@dataclass(frozen=True)
class RunContext:
    """One run: its resolved configuration, fixed once validated, and its mutable `state`."""

    run_id: str
    job: TrainJob
    resolved: ResolvedJob
    flow_run_id: str = ""
    dry_run: bool = False
    """A plan without a run (`flows.dry_run`): what it spent profiling is no part of a run's bill."""
    started_at: float = field(default_factory=time.time)
    state: RunState = field(default_factory=RunState)

    @property
    def store_ref(self) -> str:
        return self.resolved.store_ref

    @property
    def price_per_worker_s(self) -> float:
        """Dollars per second of one worker of the target's size."""
        t = self.resolved.target
        return self.resolved.offer.price_per_s(t.worker_vcpu, t.worker_memory_gb, t.worker_gpu)

    @property
    def price_per_coordinator_s(self) -> float:
        """Dollars per second of the coordinator (`ResolvedJob.price_per_coordinator_s`)."""
        return self.resolved.price_per_coordinator_s

    @property
    def coordinator_offer(self):
        """The offer the coordinator is billed as (`ResolvedJob.coordinator_billed_as`)."""
        return self.resolved.coordinator_billed_as

    def offer_of(self, capacity: str = Capacity.ON_DEMAND):
        """The offer a worker on `capacity` is billed as: the job's offer, or on `spot` the spot
        offer that shadows it (`ResolvedJob.spot`; ZooidValueError naming `capacity` where the
        target has none)."""
        if capacity != Capacity.SPOT:
            return self.resolved.offer
        if self.resolved.spot is None:
            raise ZooidValueError("capacity", f"target {self.resolved.target_name!r} has no spot offer")
        return self.resolved.spot.offer()

    def price_of(self, plan, capacity: str | None = None) -> Callable[[int], float]:
        """Dollars per second of worker `rank` of `plan` on `capacity` (None: the plan's,
        `Plan.capacity`; a replacement launched on-demand passes `on_demand`): its stage's size
        where the plan has per-stage sizes (`Plan.memory_gb_of`), else the target's."""
        t, offer = self.resolved.target, self.offer_of(capacity or getattr(plan, "capacity", Capacity.ON_DEMAND))
        if not getattr(plan, "stage_memory_gb", ()):
            price = offer.price_per_s(t.worker_vcpu, t.worker_memory_gb, t.worker_gpu)
            return lambda rank: price
        return lambda rank: offer.price_per_s(t.worker_vcpu, plan.memory_gb_of(rank), t.worker_gpu)

    @property
    def durable_ref(self) -> str:
        return self.resolved.durable_ref

    def open_store(self):
        """A fresh client of the run's store (scratch: tensors in flight)."""
        return open_store_ref(self.store_ref)

    def open_durable(self):
        """A fresh client of the durable store: data subsets, checkpoints, history, ledger,
        summary (the same store unless the scratch store may lose keys, e.g. Redis)."""
        return open_store_ref(self.durable_ref)

    @property
    def channel_ref(self) -> str:
        """The store the warm workers' channel goes through (commands, replies, status, lease,
        release: `runtime.warm`): the run's store where it is another than the durable one (Redis:
        in memory, its requests free and fast; the pool survives a restart that empties it,
        `coordinator.workers.warm_pool`), else the durable store."""
        return self.store_ref if self.store_ref != self.durable_ref else self.durable_ref

    def open_channel(self):
        """A fresh client of the warm channel's store (`channel_ref`)."""
        return open_store_ref(self.channel_ref)

    def log_dir(self) -> Path:
        return zooid_home() / "logs" / self.run_id

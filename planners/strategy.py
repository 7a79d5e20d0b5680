"""Choose among Local-SGD, pipeline and hybrid D x M for a job, from measured numbers.

The inputs are plain numbers (the profile's per-layer times and sizes, the store's bandwidth
and latency, the worker's price), so this is pure and testable without torch or Prefect.

- Local-SGD with D = `workers` replicas: a step is one replica's forward/backward at the
  job's batch, plus the store allreduce (scatter-reduce) of the parameters and optimizer state
  every k steps, amortised over the k steps.
- Pipeline / hybrid with D replicas of an M-stage pipeline: `planners.hybrid` (Hydrozoa's
  pipeline runtime with store transport plus the pipelined scatter-reduce of each stage's
  gradients, the contract's objective) chooses the candidates and their cuts, at the same
  per-replica batch split into `microbatches` micro-batches; each chosen plan's iteration
  time is then predicted by `planners.pipeline_time`, which replays the schedule as the
  executor runs it (affine layer times, overlapped transfers, hand-off paid when a reader
  waits, per-stage sync and optimizer step). The contract's figure stays in the plan as
  `planner_objective_s`.

Every candidate gets a predicted iteration time, epoch time, cost per epoch and throughput
per dollar; `auto` picks the cheapest epoch among the fastest (throughput within 5 % of the
best), so it never pays much more for a marginal speed-up. An epoch's cost is its workers' and
its store's: each candidate's store requests (`planners.store_requests`, by its strategy, D,
stages, micro-batches, sync period and collective) priced by the run's store's offer
(`StrategyInputs.store_request_usd`), and a store server's seconds (issue #45).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from core.epoch_steps import epoch_steps
from core.kinds import PIPELINED_STRATEGIES, PipelineSchedule, Strategy
from core.outer_sync import averages_gradients, wire_bytes
from core.plan import Plan
from planners.hybrid import hybrid
from planners.partition import PartitionProblem, PipelineLayer, plan_partition
from planners.pipeline_time import PipelineTime, TransferCosts, pipeline_iteration, stage_times
from planners.store_requests import epoch_store_ops
from planners.sync_time import pipelined_scatter_reduce, ring_allreduce, scatter_reduce


@dataclass(frozen=True, kw_only=True)
class StrategyInputs:
    """What the planner needs to know about a job, its profile and its target."""

    layers: tuple[dict, ...]
    """Per layer at `profile_batch` samples: forward_s, backward_s, output_bytes, param_bytes,
    and optionally forward_fixed_s, backward_fixed_s (the per-call part of an affine fit)."""
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
    transfer: TransferCosts | None = None
    """Measured per-direction put/get costs and hand-off delay of the store (None: the
    contract's symmetric `bandwidth` and `latency`)."""
    optimizer_step_s: float = 0.0
    """One optimizer step of the whole model; a pipeline stage pays its parameter share."""
    sync_bandwidth: float | None = None
    """Effective bandwidth of the store collectives, fitted from timed ones (None: `bandwidth`)."""
    sync_latency: float | None = None
    """Effective per-round latency of the store collectives (None: `latency`)."""
    checkpoint_s: float | None = None
    """Measured seconds of the sync checkpoint rank 0 writes at every Local-SGD sync (None:
    one put of the synchronised bytes)."""
    synced_step_s: float | None = None
    """One step at `batch_size` measured right after a sync checkpoint write, as a replica
    that syncs runs it (None: `step_s`)."""
    contention: float = 1.0
    """beta >= 1: compute slowdown while the same worker's transfers run (FuncPipe Sec.
    3.4.2), measured with transfers running the whole time. A pipeline stage transfers
    while it computes, so its forward and backward times are scaled by it in proportion to
    the share of its compute its transfers last (`stage_contention`); Local-SGD does not
    overlap the two."""
    host_cores: int | None = None
    """Cores of the one machine all of a plan's worker processes share (the `inline` and
    local `process` targets); None: each worker has a machine or container of its own."""
    sync_dtype: str = "float32"
    """What the data-parallel syncs move (`core.outer_sync.wire_bytes`): Local-SGD's rounds and
    a hybrid's gradient syncs."""
    outer_optimizer: str = "average"
    """`nesterov` adds its momentum buffer (one parameter copy) to the sync checkpoint."""
    store_request_usd: dict = field(default_factory=dict)
    """Dollars of one request on the run's store, by kind (`core.store_ops.REQUEST_KINDS`; a
    kind absent is free): its offer's prices (`planners.store_prices.StoreOffer.prices`); empty:
    a free store (a directory, a Redis on this machine)."""
    store_usd_per_s: float = 0.0
    """Dollars per second of the store's server (a cloud Redis node), 0 when it has none."""
    pipeline_store_request_usd: dict | None = None
    """Dollars of one request by kind on the store a pipeline's stages move their tensors through
    (the run's durable store); None: `store_request_usd` (one store for everything)."""
    ring: bool = False
    """The replicas average over the ring (the job's `collective`), not through the store."""
    collectives: tuple[str, ...] = ()
    """The collectives the planner compares for each plan of several replicas (the job's
    `collective=auto`: `store`, and `ring` where the ring may run); empty: the job's own
    (`ring`). Each is priced by its requests (the ring makes none) and timed by its link."""
    ring_link: tuple[float, float] | None = None
    """(bandwidth, latency) of one hop between two workers, the ring's link (the catalog's
    `tcp` row, `planners.catalog.store_figures`); None: the store collectives' link."""

    def compute_slowdown(self, processes: int) -> float:
        """How much slower each of a plan's `processes` worker processes computes than the
        profile's worker: 1 with a machine each, or while the shared machine has a core per
        process; processes / cores where they outnumber the cores (time-sharing)."""
        if self.host_cores is None or processes <= 1:
            return 1.0
        return max(1.0, processes / self.host_cores)

    @property
    def transfer_costs(self) -> TransferCosts:
        """`transfer`, or the contract's store when no probe measured it."""
        return self.transfer or TransferCosts.from_contract(self.bandwidth, self.latency)

    @property
    def plan_collectives(self) -> tuple[str, ...]:
        """The collectives each plan of several replicas is planned over, the first for a plan
        of one replica (which averages nothing)."""
        return self.collectives or (("ring",) if self.ring else ("store",))

    @property
    def sync_link(self) -> tuple[float, float]:
        """(bandwidth, latency) of the store collectives."""
        return (self.sync_bandwidth if self.sync_bandwidth is not None else self.bandwidth,
                self.sync_latency if self.sync_latency is not None else self.latency)


def sync_wire_bytes(x: StrategyInputs) -> float:
    """Bytes of one Local-SGD sync's tensors as they travel in the job's sync dtype: the size
    the collective moves. Parameters and optimizer state; every step, the gradients alone
    (`core.outer_sync.averages_gradients`)."""
    copies = 0 if averages_gradients(x.sync_period, x.outer_optimizer, x.sync_dtype) else x.optimizer_copies
    return wire_bytes(x.param_bytes * (1 + copies), x.sync_dtype)


def with_sync(x: StrategyInputs, plan: Plan) -> Plan:
    """`plan` naming its data-parallel sync: the outer step, the dtype and the bytes of state
    one sync reduces as they travel (Local-SGD: parameters and optimizer state; a hybrid:
    every stage's gradients; none for one replica)."""
    if plan.data_parallel <= 1:
        nbytes = 0.0
    elif plan.strategy == Strategy.LOCAL_SGD:
        nbytes = sync_wire_bytes(x)
    else:
        nbytes = wire_bytes(x.param_bytes, x.sync_dtype)
    return replace(plan, outer_optimizer=x.outer_optimizer if plan.strategy == Strategy.LOCAL_SGD else "average",
                   sync_dtype=x.sync_dtype, sync_bytes=nbytes)


def outer_state_s(x: StrategyInputs) -> float:
    """Seconds a Local-SGD round adds for its outer state: a compressed sync's replicas each
    write their float32 residual before posting their reduced slice (one put in parallel),
    and `nesterov`'s momentum (one parameter copy) rides in the sync checkpoint."""
    costs = x.transfer_costs
    residual = costs.put_s(x.param_bytes * (1 + x.optimizer_copies)) if x.sync_dtype != "float32" else 0.0
    momentum = x.param_bytes / costs.put_bandwidth if x.outer_optimizer == "nesterov" else 0.0
    return residual + momentum


def local_sgd(x: StrategyInputs, workers: int | None = None, collective: str | None = None) -> Plan:
    """The Local-SGD plan for `workers` (default: the job's) replicas over `collective`
    (default: the first the job allows): the scatter-reduce of the sync's wire bytes at the
    collectives' fitted link, or the ring allreduce at the ring's (`ring_sync_s`), plus the
    sync checkpoint write (measured, or one put) and the outer state's writes, alike for both."""
    sync_bytes = sync_wire_bytes(x)
    checkpoint_s = sync_checkpoint_s(x) + outer_state_s(x)
    bandwidth, latency = x.sync_link
    workers = workers or x.workers
    collective = collective or x.plan_collectives[0]
    return plan_local_sgd(
        workers=workers, train_samples=x.n_train, batch_size=x.batch_size,
        sync_period=x.sync_period, step_s=local_sgd_step_s(x, workers), sync_bytes=sync_bytes, bandwidth=bandwidth,
        latency=latency, worker_vcpu=x.worker_vcpu, worker_memory_gb=x.worker_memory_gb,
        worker_gpu=x.worker_gpu, offer=x.offer, price_per_worker_s=x.price_per_worker_s,
        checkpoint_s=checkpoint_s,
        ring_s=ring_sync_s(x, sync_bytes, workers) if collective == "ring" else None)


def ring_sync_s(x: StrategyInputs, nbytes: float, workers: int) -> float:
    """Seconds of one ring allreduce of `nbytes` among `workers` replicas at the ring's link
    (`StrategyInputs.ring_link`; the store collectives' where none is known): 2 (W - 1) hops
    of nbytes / W, each paying the link's latency (`planners.sync_time.ring_allreduce`)."""
    bandwidth, latency = x.ring_link or x.sync_link
    return ring_allreduce(nbytes, workers, bandwidth, 0.0, latency)


def sync_checkpoint_s(x: StrategyInputs) -> float:
    """The sync checkpoint rank 0 writes at every Local-SGD sync: measured, or one put of the
    synchronised bytes (parameters and optimizer state)."""
    if x.checkpoint_s is not None:
        return x.checkpoint_s
    return x.transfer_costs.put_s(x.param_bytes * (1 + x.optimizer_copies))


def local_sgd_step_s(x: StrategyInputs, workers: int) -> float:
    """A Local-SGD replica's mean step among `workers`: one step in k follows a sync (and
    rank 0's checkpoint write) and runs at that measured pace; all are slowed by sharing the
    machine (`StrategyInputs.compute_slowdown`)."""
    k, slow = x.sync_period, x.compute_slowdown(workers)
    if not k:
        return x.step_s * slow
    synced = x.synced_step_s if x.synced_step_s is not None else x.step_s
    return (synced + (k - 1) * x.step_s) / k * slow


_FIXED = ("forward_fixed_s", "backward_fixed_s")


def _microbatch_layers(x: StrategyInputs, microbatch_size: int) -> list[dict]:
    """The layers at `microbatch_size` rows, each time affine in the rows (the fixed part
    is kept so that merging and stage sums stay exact)."""
    stages = stage_times(x.layers, range(len(x.layers) - 1), microbatch_size, x.profile_batch)
    return [{"forward_s": st["forward_s"], "backward_s": st["backward_s"],
             "output_bytes": st["out_bytes"], "param_bytes": l["param_bytes"],
             **{k: l.get(k, 0.0) for k in _FIXED}}
            for st, l in zip(stages, x.layers)]


def merge_parameter_free(layers) -> tuple[list[dict], list[int]]:
    """Fold each layer without parameters (a reshape, an activation) into the next layer, or
    the last ones into the previous layer, so that no stage is a worker paid to hold no
    weights. Returns the merged layers and, per merged layer, the original index of its last
    layer (a merged cut i is the original cut `last[i]`)."""
    merged, last, pending = [], [], []
    for i, layer in enumerate(layers):
        pending.append(layer)
        if layer["param_bytes"] > 0:
            merged.append({"forward_s": sum(l["forward_s"] for l in pending),
                           "backward_s": sum(l["backward_s"] for l in pending),
                           "output_bytes": layer["output_bytes"], "param_bytes": sum(l["param_bytes"] for l in pending),
                           **_fixed_sums(pending)})
            last.append(i)
            pending = []
    if pending and merged:
        tail = merged[-1]
        merged[-1] = {"forward_s": tail["forward_s"] + sum(l["forward_s"] for l in pending),
                      "backward_s": tail["backward_s"] + sum(l["backward_s"] for l in pending),
                      "output_bytes": pending[-1]["output_bytes"], "param_bytes": tail["param_bytes"],
                      **_fixed_sums([tail] + pending)}
        last[-1] = len(layers) - 1
    return merged, last


def _fixed_sums(layers) -> dict:
    """The summed per-call parts of merged layers (only where some layer has one)."""
    return {k: sum(l.get(k, 0.0) for l in layers) for k in _FIXED if any(k in l for l in layers)}


def pipeline_plans(x: StrategyInputs, *, cluster: int, global_batch: int, microbatch_size: int,
                   max_stages: int | None = None) -> list[Plan]:
    """Every A x B plan with B >= 2 stages and A * B <= `cluster` workers that keeps the
    global batch: each of the A replicas pipelines global_batch / A samples as micro-batches
    of `microbatch_size` (Hydrozoa Alg. 1 through `planners.hybrid`, which picks the cuts),
    each predicted by `pipeline_prediction`."""
    if len(x.layers) < 2 or microbatch_size < 1:
        return []
    layers, last = merge_parameter_free(_microbatch_layers(x, microbatch_size))
    if len(layers) < 2:
        return []
    doc = {"layers": layers, "bandwidth_bytes_per_s": x.bandwidth,
           "latency_s": x.latency, "transport": "store", "max_stages": min(max_stages or len(layers), len(layers)),
           "cluster_size": cluster, "global_batch": global_batch, "microbatch_size": microbatch_size,
           "sync": "pipelined_scatter_reduce"}
    answer = hybrid(doc)
    if not answer.get("feasible"):
        return []
    plans = []
    for c in answer["candidates"]:
        if c["stages"] < 2:
            continue  # plain data parallelism is Local-SGD's candidate
        replicas, batch = c["data_parallel"], global_batch // c["data_parallel"]
        steps = epoch_steps(x.n_train, replicas, batch)  # the workers' own count
        # the solver's cuts are on merged layers; the plan (and the executor) use the originals
        plan = Plan(strategy=Strategy.HYBRID if replicas > 1 else Strategy.PIPELINE, data_parallel=replicas,
                    stages=c["stages"], cuts=tuple(last[i] for i in c["cuts"]),
                    microbatches=c["microbatches"], sync_period=1, steps_per_epoch=steps,
                    collective=x.plan_collectives[0],
                    batch_size=batch, worker_vcpu=x.worker_vcpu,
                    worker_memory_gb=x.worker_memory_gb, worker_gpu=x.worker_gpu, offer=x.offer,
                    price_per_worker_s=x.price_per_worker_s, planner_objective_s=c["time_s"])
        plans.append(predicted(x, plan))
    return plans


def predicted(x: StrategyInputs, plan: Plan) -> Plan:
    """A pipeline or hybrid `plan` with its iteration, compute, epoch and cost predicted."""
    timing = pipeline_prediction(x, plan)
    epoch_s = plan.steps_per_epoch * timing.period_s
    return replace(plan, predicted_iteration_s=timing.period_s, predicted_epoch_s=epoch_s,
                   predicted_compute_epoch_s=epoch_s, predicted_compute_s=busiest_compute_s(timing),
                   predicted_cost_per_epoch_usd=epoch_s * plan.workers * x.price_per_worker_s)


def busiest_compute_s(timing: PipelineTime) -> float:
    """The busiest stage's forward and backward seconds per iteration (the rest of its
    period is transfers, waits and sync)."""
    return max(timing.period_s * (1.0 - b) for b in timing.bubble)


def pipeline_prediction(x: StrategyInputs, plan: Plan) -> PipelineTime:
    """The executor-faithful iteration time of a pipeline or hybrid `plan` (its cuts, D,
    stages and micro-batches) for the job `x`: stage times at the plan's micro-batch, the
    store's transfer costs, each stage's pipelined scatter-reduce among its D replicas and
    its parameter share of the optimizer step; forward and backward slowed by the
    contention factor, and compute by the plan's processes sharing one machine
    (`StrategyInputs.compute_slowdown`)."""
    if plan.microbatches < 1 or plan.batch_size % plan.microbatches:
        raise ValueError(f"microbatches: {plan.microbatches} does not split the batch of {plan.batch_size}")
    stages = stage_times(x.layers, plan.cuts, plan.batch_size // plan.microbatches, x.profile_batch)
    shared = x.compute_slowdown(plan.workers)
    costs = x.transfer_costs
    for beta, st in zip(stage_contention(x.contention, stages, costs), stages):
        # a stage's transfer threads share its CPU with its compute
        st["forward_s"] *= beta * shared
        st["backward_s"] *= beta * shared
    bandwidth, latency = x.sync_link
    if plan.collective == "ring":
        sync_s = [ring_sync_s(x, wire_bytes(st["param_bytes"], x.sync_dtype), plan.data_parallel) for st in stages]
    else:
        sync_s = [pipelined_scatter_reduce(wire_bytes(st["param_bytes"], x.sync_dtype), plan.data_parallel,
                                           bandwidth, latency)
                  for st in stages]
    optimizer_s = optimizer_shares(x.optimizer_step_s * shared, [st["param_bytes"] for st in stages])
    return pipeline_iteration(stages, plan.microbatches, costs, sync_s=sync_s, optimizer_s=optimizer_s,
                              schedule=plan.pipeline_schedule, chunks=plan.chunks)


def with_schedule(x: StrategyInputs, plan: Plan, schedule: str, chunks: int = 1) -> Plan:
    """`plan` (one model stage per worker, as `choose` makes them) run with another pipeline
    schedule, its time and cost predicted again.

    `interleaved` with v = `chunks` >= 2 cuts the model again, into `plan.stages` x v model
    stages (worker w then holds stages w, w + p, ...): the partition of the merged layers
    (`merge_parameter_free`, so no model stage is without parameters) that the contract's
    runtime model (`planners.partition.plan_partition`, store transport) finds best for that
    many stages, at the plan's micro-batch. Raises ValueError when the micro-batches are not
    a multiple of the p workers or the model has fewer than p x v layers with parameters."""
    if schedule != PipelineSchedule.INTERLEAVED:
        return predicted(x, replace(plan, pipeline_schedule=schedule))
    stages = plan.stages * chunks
    if chunks < 2 or plan.microbatches % plan.stages:
        raise ValueError(f"chunks: interleaved needs v >= 2 chunks (got {chunks}) and micro-batches that are "
                         f"a multiple of the {plan.stages} workers (got {plan.microbatches})")
    layers, last = merge_parameter_free(_microbatch_layers(x, max(1, plan.batch_size // plan.microbatches)))
    if len(layers) < stages:
        raise ValueError(f"chunks: {plan.stages} workers x {chunks} chunks need {stages} layers with "
                         f"parameters, the model has {len(layers)}")
    problem = PartitionProblem(
        layers=tuple(PipelineLayer(forward_s=l["forward_s"], backward_s=l["backward_s"],
                                   output_bytes=l["output_bytes"], param_bytes=l["param_bytes"]) for l in layers),
        bandwidth_bytes_per_s=x.bandwidth, latency_s=x.latency, microbatches=plan.microbatches,
        max_stages=stages, transport="store")
    cuts = tuple(last[i] for i in plan_partition(problem)[stages].cuts)
    return predicted(x, replace(plan, pipeline_schedule=PipelineSchedule.INTERLEAVED, chunks=chunks, cuts=cuts))


def choose_schedule(options: list[Plan]) -> Plan:
    """Among the same pipeline under several schedules (each fitting its workers, listed from
    the least activation memory held to the most), the fastest predicted; a schedule listed
    earlier wins when it is within 1 % of that. `interleaved` holds the most activation sets
    on worker 0 (p + (p - 1)/v stage-sized sets against 1F1B's p) but runs a bubble about v
    times smaller, so listed after 1F1B it is chosen when it is more than 1 % faster."""
    fastest = min(p.predicted_iteration_s for p in options)
    return next(p for p in options if p.predicted_iteration_s <= fastest * 1.01)


def stage_contention(beta: float, stages: list[dict], costs: TransferCosts) -> list[float]:
    """Per stage, the compute slowdown its own transfers cause: 1 + (beta - 1) x duty, where
    beta is measured with transfers running the whole time and duty is the share of the
    stage's forward and backward time that its puts and gets last (at most 1). A stage of a
    small model that moves a few KB per micro-batch pays little of a large beta."""
    last = len(stages) - 1
    factors = []
    for s, st in enumerate(stages):
        moved = []
        if s < last:  # its activation out, the gradient of it back in
            moved += [costs.put_s(st["out_bytes"]), costs.get_s(st["out_bytes"])]
        if s > 0:  # its input in, the gradient of its input out
            moved += [costs.get_s(stages[s - 1]["out_bytes"]), costs.put_s(stages[s - 1]["out_bytes"])]
        compute = st["forward_s"] + st["backward_s"]
        duty = min(1.0, sum(moved) / compute) if compute > 0 else 0.0
        factors.append(1.0 + (beta - 1.0) * duty)
    return factors


def optimizer_shares(optimizer_step_s: float, stage_param_bytes: list[float]) -> list[float]:
    """Each stage's part of the whole model's optimizer step: its share of the parameters
    (equal parts when no stage holds any)."""
    total = sum(stage_param_bytes)
    return [optimizer_step_s * p / total if total > 0 else optimizer_step_s / len(stage_param_bytes)
            for p in stage_param_bytes]


def store_request_usd(x: StrategyInputs, plan: Plan) -> float:
    """Dollars of one epoch's store requests of `plan` (`epoch_store_ops`, over the ring when
    the plan's or the job's collective is) at the prices of the store its workers use: the
    run's store, or for a pipeline's stages the durable store (`pipeline_store_request_usd`)."""
    ops = epoch_store_ops(plan, ring=x.ring or plan.collective == "ring")
    prices = x.store_request_usd
    if plan.stages > 1 and x.pipeline_store_request_usd is not None:
        prices = x.pipeline_store_request_usd  # a pipeline's stages use the durable store
    return sum(getattr(ops, kind) * price for kind, price in prices.items())


def store_usd_per_epoch(x: StrategyInputs, plan: Plan) -> float:
    """Dollars one epoch of `plan` pays the store: its requests and its server for the epoch."""
    return store_request_usd(x, plan) + x.store_usd_per_s * plan.predicted_epoch_s


def epoch_usd(x: StrategyInputs, plan: Plan) -> float:
    """The whole epoch's dollars the planner weighs: the workers' and the store's."""
    return plan.predicted_cost_per_epoch_usd + store_usd_per_epoch(x, plan)


def describe(plan: Plan, chosen: bool = False, store_usd: float = 0.0) -> dict:
    """A plan as one row of the alternatives table; `store_usd`: what one epoch's store
    requests of it cost (`store_request_usd`; a store server's seconds are the run's)."""
    per_epoch = plan.predicted_cost_per_epoch_usd
    samples = plan.steps_per_epoch * plan.batch_size * plan.data_parallel
    return {"strategy": plan.strategy, "data_parallel": plan.data_parallel, "stages": plan.stages,
            "workers": plan.workers, "cuts": list(plan.cuts), "microbatches": plan.microbatches,
            "pipeline_schedule": plan.pipeline_schedule if plan.stages > 1 else None,
            "chunks": plan.chunks, "collective": plan.collective,
            "predicted_iteration_s": plan.predicted_iteration_s,
            "predicted_epoch_s": plan.predicted_epoch_s,
            "predicted_cost_per_epoch_usd": per_epoch,
            "planner_objective_s": plan.planner_objective_s if plan.stages > 1 else None,
            "throughput_per_dollar": (samples / plan.predicted_epoch_s) / (per_epoch / plan.predicted_epoch_s * 3600)
            if per_epoch > 0 and plan.predicted_epoch_s > 0 else None,
            "predicted_store_usd_per_epoch": store_usd,
            "chosen": chosen}


def job_microbatches(batch_size: int, microbatches: int | None) -> int:
    """The micro-batches one replica splits its `batch_size` into: the job's request, or the
    most of 4, 2, 1 that divides the batch.

    A choice made from the job before planning, which fixes the micro-batch size
    (batch_size // count). Not `planners.hybrid.microbatches_per_replica`, which derives
    the count from that fixed size for each replica count (global batch / (A x size))."""
    return microbatches or next((m for m in (4, 2, 1) if batch_size % m == 0), 1)


def candidates(x: StrategyInputs, strategy: str) -> list[Plan]:
    """The plans `strategy` may choose from.

    `local_sgd`: D = workers replicas. `pipeline`: one replica of `stages` stages (all stage
    counts when None) at the job's batch. `hybrid`: D = workers replicas of it. `auto`: every
    plan of at most `workers` worker processes at the same global batch (workers x
    batch_size): Local-SGD, and each A x B pipeline with A * B <= workers."""
    return over_collectives(x, _candidates(x, strategy))


def over_collectives(x: StrategyInputs, plans: list[Plan]) -> list[Plan]:
    """Each plan of several replicas once per collective the job allows
    (`StrategyInputs.plan_collectives`: under `collective=auto` the store's and the ring's,
    each timed and priced by its own), a plan of one replica once."""
    out = []
    for plan in plans:
        for collective in x.plan_collectives[:1] if plan.data_parallel <= 1 else x.plan_collectives:
            out.append(over_collective(x, plan, collective))
    return out


def over_collective(x: StrategyInputs, plan: Plan, collective: str) -> Plan:
    """`plan` with its replicas averaging over `collective`, its time and cost predicted again."""
    if plan.collective == collective:
        return plan
    if plan.strategy == Strategy.LOCAL_SGD:
        return local_sgd(x, plan.data_parallel, collective)
    return predicted(x, replace(plan, collective=collective))


def _candidates(x: StrategyInputs, strategy: str) -> list[Plan]:
    """`candidates` over the job's first collective."""
    mb = job_microbatches(x.batch_size, x.microbatches)
    if strategy == Strategy.LOCAL_SGD:
        return [local_sgd(x)]
    if strategy in PIPELINED_STRATEGIES:
        replicas = 1 if strategy == Strategy.PIPELINE else x.workers
        stages = x.stages or len(x.layers)
        if x.batch_size % mb:
            return []
        plans = pipeline_plans(x, cluster=replicas * stages, global_batch=replicas * x.batch_size,
                               microbatch_size=x.batch_size // mb, max_stages=stages)
        return [p for p in plans if p.data_parallel == replicas and (not x.stages or p.stages == x.stages)]
    return [local_sgd(x)] + pipeline_plans(x, cluster=x.workers, global_batch=x.workers * x.batch_size,
                                            microbatch_size=max(1, x.batch_size // mb))


NO_PLAN_FITS = "memory: no plan's workers fit their memory"
"""What `choose` raises (as a ValueError) when `fits` refuses every candidate."""


def choose(x: StrategyInputs, strategy: str, fits: Callable[[Plan], bool] | None = None) -> Plan:
    """The plan for `strategy` (`auto` compares all), with the alternatives considered:
    the highest throughput, and among plans within 5 % of it the cheapest epoch, workers and
    store (`fastest_cheapest`). With `fits`
    (whether a plan's workers hold what it keeps: a model too large for one worker is
    pipelined), only the candidates it accepts are chosen from; the others stay in the
    alternatives, marked `fits: False`; ValueError(`NO_PLAN_FITS`) when it accepts none."""
    wanted = candidates(x, strategy)
    if not wanted:
        raise ValueError(f"strategy: no feasible {strategy} plan (the model needs top-level layers "
                         f"to split, and the batch must divide into whole micro-batches)")
    fitting = [p for p in wanted if fits(p)] if fits is not None else wanted
    if not fitting:
        raise ValueError(NO_PLAN_FITS)

    best = fastest_cheapest(x, fitting)
    fit_ids = {id(p) for p in fitting}
    return replace(best, alternatives=tuple({**describe(p, p is best, store_request_usd(x, p)),
                                             **({} if id(p) in fit_ids else {"fits": False})} for p in wanted))


def fastest_cheapest(x: StrategyInputs, plans: list[Plan]) -> Plan:
    """Among `plans`, those within 5 % of the highest throughput, and of them the cheapest
    epoch (`epoch_usd`: the workers' dollars and the store's), the faster on a tie."""
    def throughput(p: Plan) -> float:
        return p.data_parallel * p.batch_size / max(p.predicted_iteration_s, 1e-12)

    best_throughput = max(throughput(p) for p in plans)
    near = [p for p in plans if throughput(p) >= best_throughput / 1.05]
    return min(near, key=lambda p: (epoch_usd(x, p), p.predicted_iteration_s))


def plan_local_sgd(*, workers: int, train_samples: int, batch_size: int, sync_period: int | None,
                   step_s: float, sync_bytes: float, bandwidth: float, latency: float,
                   worker_vcpu: float, worker_memory_gb: float, worker_gpu: int,
                   offer: str, price_per_worker_s: float, checkpoint_s: float | None = None,
                   ring_s: float | None = None) -> Plan:
    """The Local-SGD plan for `workers` replicas and its predicted step time and epoch cost.

    Each replica takes `core.epoch_steps.epoch_steps` steps, and averages
    `sync_bytes` every `sync_period` steps (once per epoch when None); each sync also writes
    the sync checkpoint (`sync_bytes` once): `checkpoint_s` seconds when measured, else
    one put at `bandwidth` and `latency`. `ring_s`: the seconds of one sync's ring allreduce,
    where the replicas average over the ring instead of the store's scatter-reduce."""
    if workers < 1:
        raise ValueError(f"workers: must be >= 1, got {workers}")
    steps = max(1, epoch_steps(train_samples, workers, batch_size))
    syncs = 1 if sync_period is None else math.ceil(steps / sync_period)
    # the decentralised average is a scatter-reduce then all-gather (FuncPipe Eq. 1), and at
    # every sync rank 0 writes the averaged state as the sync checkpoint (one put) before the
    # next round can complete
    if checkpoint_s is None:
        checkpoint_s = sync_bytes / bandwidth + latency
    reduce_s = scatter_reduce(sync_bytes, workers, bandwidth, latency) if ring_s is None else ring_s
    sync_s = (reduce_s + checkpoint_s) * syncs
    epoch_s = steps * step_s + sync_s
    return Plan(strategy=Strategy.LOCAL_SGD, data_parallel=workers, sync_period=sync_period,
                collective="store" if ring_s is None else "ring",
                steps_per_epoch=steps, batch_size=batch_size, worker_vcpu=worker_vcpu,
                worker_memory_gb=worker_memory_gb, worker_gpu=worker_gpu, offer=offer,
                price_per_worker_s=price_per_worker_s,
                predicted_iteration_s=epoch_s / steps, predicted_epoch_s=epoch_s,
                predicted_compute_epoch_s=epoch_s, predicted_compute_s=step_s,
                predicted_cost_per_epoch_usd=epoch_s * workers * price_per_worker_s)

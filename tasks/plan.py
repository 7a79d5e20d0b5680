"""The `plan` step: choose the parallelism and predict an epoch's time and cost.

The measured profile goes to the planners (`planners.strategy`, which calls `hybrid` with
store transport and the store collectives' sync model); the alternatives they considered,
with predicted iteration time, epoch time and cost, travel with the plan to the report.
"""
from __future__ import annotations

import dataclasses

from prefect import task
from prefect.cache_policies import NO_CACHE

from planners.pipeline_time import TransferCosts
from planners.plan import Plan
from planners.strategy import StrategyInputs, choose
from tasks.context import RunContext
from tasks.retry import task_options
from training.errors import ZooidValueError


def optimizer_copies(optimizer: str) -> int:
    """Copies of the parameters the optimizer state adds to each sync (averaged with them)."""
    return {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]


SHARED_HOST_KINDS = ("inline", "process")
"""Targets whose worker processes all run on the coordinator's machine."""

LAYER_FIELDS = ("forward_s", "backward_s", "output_bytes", "param_bytes", "forward_fixed_s",
                "backward_fixed_s")


def strategy_inputs(ctx: RunContext, profile: dict, workers: int) -> StrategyInputs:
    """The planner's view of the job, its measured profile and its target: the contract's
    store bandwidth and latency, and where the profile has them, a worker's measured put
    and get costs and the store collective's fitted link (`tasks.profile`). The hand-off
    delay timed between two worker processes, when the collective probe ran, replaces the
    one timed between two threads of the coordinator. On a target whose workers share
    this machine, the measured co-run slowdown and the machine's cores (`profile["corun"]`)
    slow each plan's compute by how many worker processes it runs at once."""
    job, target = ctx.job, ctx.resolved.target
    corun = profile.get("corun") if target.kind in SHARED_HOST_KINDS else None
    transfer = profile.get("store_transfer")
    sync = profile.get("store_sync") or {}
    if transfer and sync.get("handoff_s") is not None:
        transfer = {**transfer, "handoff_s": sync["handoff_s"]}
    return StrategyInputs(
        layers=tuple({k: l[k] for k in LAYER_FIELDS if k in l} for l in profile.get("layers", ())),
        profile_batch=profile.get("microbatch_size") or profile["batch_size"], step_s=profile["step_s"],
        param_bytes=profile["param_bytes"], optimizer_copies=optimizer_copies(job.optimizer),
        n_train=ctx.resolved.n_train, batch_size=job.batch_size, workers=workers,
        stages=job.stages, microbatches=job.microbatches, sync_period=job.sync_period,
        bandwidth=profile["store_bandwidth_bytes_per_s"], latency=profile["store_latency_s"],
        offer=ctx.resolved.offer.name, price_per_worker_s=ctx.price_per_worker_s,
        worker_vcpu=target.worker_vcpu, worker_memory_gb=target.worker_memory_gb,
        worker_gpu=target.worker_gpu, optimizer_step_s=profile.get("optimizer_step_s", 0.0),
        transfer=TransferCosts(**transfer) if transfer else None,
        sync_bandwidth=sync.get("bandwidth_bytes_per_s"), sync_latency=sync.get("latency_s"),
        checkpoint_s=profile.get("checkpoint_s"), synced_step_s=profile.get("synced_step_s"),
        contention=profile.get("contention") or 1.0,
        host_cores=corun["host_cores"] if corun else None, corun=corun["factor"] if corun else 1.0,
        transfer_wake_s=(corun.get("transfer_extra_s") or 0.0) if corun else 0.0,
        peer_synced_step_s=sync.get("synced_step_s") if corun else None)


def make_plan(ctx: RunContext, profile: dict, workers: int) -> Plan:
    """The plan for the job's strategy with `workers` replicas, refused (ZooidValueError
    naming `memory`, with the numbers per stage) when a stage does not fit its worker."""
    x = strategy_inputs(ctx, profile, workers)
    try:
        chosen = choose(x, ctx.job.strategy)
    except ValueError as exc:
        raise ZooidValueError("strategy", str(exc).removeprefix("strategy: ")) from None
    if chosen.stages > 1:
        return pick_schedule(ctx, profile, x, chosen)
    check_memory(ctx, profile, chosen)
    return chosen


def pick_schedule(ctx: RunContext, profile: dict, x, plan: Plan) -> Plan:
    """The pipeline `plan` under the job's schedule, or for `auto` the fastest predicted of
    1F1B and GPipe whose stages fit their workers (1F1B holds min(k - s, M) micro-batches of
    activations on stage s, GPipe all M; within 1 % of the fastest, the one holding less);
    the schedules compared join the plan's alternatives."""
    from planners.strategy import choose_schedule, describe, with_schedule

    names = ["1f1b", "gpipe"] if ctx.job.pipeline_schedule == "auto" else [ctx.job.pipeline_schedule]
    options, errors = [with_schedule(x, plan, name) for name in names], []
    fitting = []
    for option in options:
        try:
            check_memory(ctx, profile, option)
            fitting.append(option)
        except ZooidValueError as exc:
            errors.append(f"{option.pipeline_schedule}: {str(exc).removeprefix('memory: ')}")
    if not fitting:
        raise ZooidValueError("memory", "; ".join(errors))
    best = choose_schedule(fitting)
    compared = tuple({**describe(o, o is best), "compared": "schedule", "fits": o in fitting} for o in options)
    return dataclasses.replace(best, alternatives=plan.alternatives + compared)


def check_memory(ctx: RunContext, profile: dict, plan: Plan) -> None:
    """Every stage's activations, parameters, gradients, optimizer state and the worker
    process's base memory must fit the worker's memory."""
    from training.memory import check_plan_memory
    from training.profiler import ModelProfile

    prof = ModelProfile.from_dict(profile)
    if not prof.layers:
        return
    from training.pipeline_schedule import ideal_peak_in_flight

    micro = max(1, plan.batch_size // max(1, plan.microbatches))
    in_flight = [ideal_peak_in_flight(plan.pipeline_schedule, plan.stages, plan.microbatches, worker=s)
                 for s in range(plan.stages)]
    check_plan_memory(activation_bytes=prof.layer_activation_bytes(micro), in_flight=in_flight,
                      param_bytes=[l.param_bytes for l in prof.layers],
                      cuts=[c + 1 for c in plan.cuts], microbatches=plan.microbatches,
                      available_bytes=ctx.resolved.target.worker_memory_gb * 2**30,
                      base_memory_bytes=prof.base_memory_bytes or 0.0,
                      optimizer_state_factor=optimizer_copies(ctx.job.optimizer),
                      data_parallel=plan.data_parallel)


@task(name="plan", cache_policy=NO_CACHE, **task_options(retries=1, timeout_s=300))
def plan(ctx: RunContext, profile: dict, workers: int | None = None) -> Plan:
    """Plan the parallelism for `workers` replicas (default: the job's)."""
    return make_plan(ctx, profile, workers or ctx.job.workers)

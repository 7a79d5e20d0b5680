"""The plan step's co-optimiser: where a target offers several worker sizes, choose the
partition, each stage's size and the data-parallel degree together (`planners.co_optimize_flow`).

Inputs from the profile (taken on the target at its `worker_memory_gb`), calibrated like the
rest of the plan (`coordinator.plan.planning.make_plan`'s `StrategyInputs`):

- per-layer forward and backward seconds per micro-batch at the profiled size, the layers
  without parameters folded into their neighbour (`planners.strategy.merge_parameter_free`);
  output, activation and parameter bytes; the base memory of a worker process;
- per size: the compute time factor. Assumption, per billing: a container offer (billed per
  vCPU and GB) keeps the target's vCPU at every memory tier, so times are the profiled ones;
  a function offer (billed per GB-s) gets CPU in proportion to its memory (the offer's vCPU
  per GB), so times scale by the Amdahl ratio of the vCPUs (`profiling.profiler.vcpu_factor`
  with the profile's serial fraction);
- the store's bandwidth and latency the profile's probe measured, the same at every size
  (one size was probed);
- the bytes a data-parallel sync moves per float32 parameter byte, from the job's
  `sync_dtype` (`core.outer_sync.wire_bytes(P, dtype) / P` for the model's P float32
  parameter bytes: 1 for float32, 1/2 for bfloat16, about 1/4 for int8);
- the price of a worker of each size (`planners.catalog.Offer.price_per_s`);
- the degrees and stage counts the job's worker budget allows (`pipeline`: D = 1, `hybrid`:
  D = workers, `auto`: D x stages <= workers; the job's `stages` when it fixes them);
- the objective from the job: `budget_usd` -> the fastest within it, `deadline_s` -> the
  cheapest within it (both divided over the job's epochs and steps, the workers' compute
  alone; start-up and the coordinator are predicted after), else the fastest and within 5 %
  the cheapest.

Launch: the plan keeps the chosen sizes in `stage_memory_gb`; on a cloud target each stage's
worker asks for its own size (`coordinator.workers.launchers.make_launcher`, `Plan.memory_gb_of`), and each
worker is billed at its size (`coordinator.run.context.RunContext.price_of`). The plan's time and bill
are predicted the same way (`sized_inputs`); the co-optimiser's own figures are in
`plan.co_optimizer`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from core.epoch_steps import epoch_steps
from core.errors import ZooidValueError
from core.kinds import SINGLE_CHUNK_SCHEDULES, PipelineSchedule, Strategy
from core.plan import Plan
from core.stage_memory import stage_bounds
from planners.co_optimize import merge_layers
from planners.co_optimize_flow import (
    Point,
    SizeOption,
    build_problem,
    describe_point,
    dtype_sync_factor,
    frontier,
    only_size,
    select,
)
from planners.pipeline_time import stage_times
from planners.strategy import StrategyInputs, describe, job_microbatches, merge_parameter_free, predicted
from profiling.profiler import ModelProfile, vcpu_factor

MAX_LAYERS = 12
"""Layers given to the co-optimiser at most (adjacent ones merged by balanced compute)."""
_TIME_KEYS = ("forward_s", "backward_s", "forward_fixed_s", "backward_fixed_s")


def not_needed(plan: Plan, reason: str) -> Plan:
    """`plan` with the reason the co-optimiser did not choose it."""
    return dataclasses.replace(plan, co_optimizer={"used": False, "reason": reason})


def size_options(ctx, x: StrategyInputs, sizes: tuple[float, ...], profile: dict) -> list[SizeOption]:
    """Each size's vCPU, time factor, bandwidth and price (module docstring)."""
    target, offer = ctx.resolved.target, ctx.resolved.offer
    per_memory = offer.kind == "function" and offer.memory_gb > 0
    serial = float(profile.get("serial_fraction", 1.0))

    def vcpu(gb: float) -> float:
        return offer.vcpu * gb / offer.memory_gb if per_memory else target.worker_vcpu

    ref = vcpu(target.worker_memory_gb)
    return [SizeOption(memory_gb=gb, vcpu=vcpu(gb), bandwidth_bytes_per_s=x.bandwidth,
                       time_factor=vcpu_factor(vcpu(gb), serial) / vcpu_factor(ref, serial) if per_memory else 1.0,
                       price_per_s=offer.price_per_s(vcpu(gb), gb, target.worker_gpu)) for gb in sizes]


def problem_layers(x: StrategyInputs, profile: dict, microbatch_size: int) -> tuple[list[dict], list[int]]:
    """Layers at `microbatch_size` rows for the co-optimiser, and per layer the original index
    of its last layer (a co-optimiser cut i is the plan's cut `last[i]`)."""
    acts = ModelProfile.from_dict(profile).layer_activation_bytes(microbatch_size)
    times = stage_times(x.layers, range(len(x.layers) - 1), microbatch_size, x.profile_batch)
    layers = [{"forward_s": st["forward_s"], "backward_s": st["backward_s"], "output_bytes": st["out_bytes"],
               "param_bytes": l["param_bytes"]} for st, l in zip(times, x.layers)]
    merged, last = merge_parameter_free(layers)
    for m, (a, b) in zip(merged, stage_bounds([i + 1 for i in last[:-1]], len(layers))):
        m["activation_bytes"] = float(sum(acts[a:b + 1]))
    return merged, last


def degrees_and_stages(job, workers: int, num_layers: int):
    """(degrees, stages(d) -> (fewest, most)) the job's strategy and worker budget allow."""
    low, high = (job.stages, job.stages) if job.stages else (2, num_layers)
    if job.strategy == Strategy.PIPELINE:
        return [1], lambda d: (low, high)
    if job.strategy == Strategy.HYBRID:
        return [workers], lambda d: (low, high)
    return list(range(1, workers + 1)), lambda d: (low, min(high, workers // d))


def co_optimized(ctx, profile: dict, x: StrategyInputs, uniform: Plan | None, workers: int, *,
                 check_memory: Callable[[Plan], None], why_uniform: str = "") -> Plan | None:
    """The co-optimised plan (its `co_optimizer` lists what was compared), or `uniform` with
    the reason the co-optimiser was not used; None when neither exists. `uniform` is the plan
    at the target's size (None: it does not fit, `why_uniform` says why); `check_memory`
    refuses a plan whose stage does not fit its size (`coordinator.plan.planning.check_memory`)."""
    job, target = ctx.job, ctx.resolved.target
    sizes = target.memory_options()
    if len(sizes) < 2:
        return uniform and not_needed(uniform, f"the target offers one worker size ({sizes[0]:g} GB)")
    if job.strategy == Strategy.LOCAL_SGD or job.outer_optimizer == "nesterov" or ctx.resolved.shared_parameters:
        return uniform and not_needed(uniform, "the job's strategy is local_sgd; the co-optimiser plans "
                                               "pipelines (partition, per-stage size, D)")
    mb = job_microbatches(x.batch_size, x.microbatches)
    micro = max(1, x.batch_size // mb)
    layers, last = problem_layers(x, profile, micro)
    if len(layers) < 2:
        return uniform and not_needed(uniform, "the model has fewer than two layers with parameters to split")
    replicas = 1 if job.strategy == Strategy.PIPELINE else workers
    total = replicas * mb                      # micro-batches per iteration, all replicas together
    degrees, stages = degrees_and_stages(job, workers, len(layers))
    options = size_options(ctx, x, sizes, profile)
    problem = build_problem(layers, options, latency_s=x.latency, contention=x.contention,
                            base_memory_bytes=float(profile.get("base_memory_bytes") or 0.0),
                            optimizer_state_factor=x.optimizer_copies,
                            microbatches=total, dp_degrees=degrees,
                            sync_bytes_factor=dtype_sync_factor(x.param_bytes, x.sync_dtype))
    if problem.num_layers > MAX_LAYERS:
        problem, groups = merge_layers(problem, MAX_LAYERS)
        last = [last[b] for _, b in groups]
    steps = epoch_steps(ctx.resolved.n_train, 1, total * micro)  # iterations of the global batch (to_plan: D's own)
    iterations = steps * job.epochs
    points = frontier(problem, stages)
    point, rule = select(points, max_cost=job.budget_usd / iterations if job.budget_usd else None,
                         max_time=job.deadline_s / iterations if job.deadline_s else None)
    record = {"used": False, "sizes_gb": list(sizes), "solver": "exact", "rule": rule,
              "sync_dtype": x.sync_dtype, "sync_bytes_factor": problem.sync_bytes_factor,
              "assumption": ("CPU in proportion to memory (function offer)" if options[0].time_factor != 1.0
                             or options[-1].time_factor != 1.0 else "the same speed at every size "
                             "(the size changes memory only)"),
              "frontier": [describe_point(problem, p, steps, [last[c] for c in p.solution.cuts]) for p in points[:12]]}
    uniform_best = []
    for j, gb in enumerate(sizes):
        best, _ = select(frontier(only_size(problem, j), stages), max_cost=None, max_time=None)
        uniform_best.append({"memory_gb": gb, **(describe_point(only_size(problem, j), best, steps,
                             [last[c] for c in best.solution.cuts]) if best else {"fits": False})})
    record["uniform_by_size"] = uniform_best
    if uniform is not None:
        record["uniform"] = _summary(uniform)
    if point is None:
        if uniform is None:
            raise ZooidValueError("memory", f"{why_uniform}; and no stage assignment fits any of "
                                            f"{', '.join(f'{g:g}' for g in sizes)} GB")
        return dataclasses.replace(uniform, co_optimizer={**record, "reason": "no co-optimised plan fits"})
    chosen = to_plan(ctx, x, problem, point, options, [last[c] for c in point.solution.cuts], total, micro)
    check_memory(chosen)
    record["co_optimised"] = {**describe_point(problem, point, steps, chosen.cuts), **_summary(chosen)}
    if uniform is not None and uniform.stages == 1 and not _better(chosen, uniform, job):
        record["reason"] = f"the uniform {uniform.strategy} plan predicts better than the co-optimised pipeline"
        return dataclasses.replace(uniform, co_optimizer=record)
    record.update(used=True, reason=f"{len(sizes)} worker sizes: {rule}")
    rows = tuple({**a, "chosen": False, "price_per_worker_s": a.get("price_per_worker_s", uniform.price_per_worker_s)}
                 for a in (uniform.alternatives if uniform else ()))

    rows += ({**describe(chosen, True), "compared": "co-optimiser", "stage_memory_gb": list(chosen.stage_memory_gb),
              "price_per_worker_s": chosen.price_per_worker_s},)
    return dataclasses.replace(chosen, co_optimizer=record, alternatives=rows)


def to_plan(ctx, x: StrategyInputs, problem, point, options: list[SizeOption], cuts: list[int],
            total: int, micro: int) -> Plan:
    """The solution as the flow's plan: its cuts on the profile's layers, per-stage sizes, D,
    micro-batches per replica, predicted with each stage's worker at its own size."""
    s = point.solution
    chosen = [options[j] for j in s.options]
    launch = sized_inputs(x, cuts, chosen)
    schedule = ctx.job.pipeline_schedule if ctx.job.pipeline_schedule in SINGLE_CHUNK_SCHEDULES else PipelineSchedule.GPIPE
    plan = Plan(strategy=Strategy.HYBRID if s.d > 1 else Strategy.PIPELINE, data_parallel=s.d, stages=len(s.options),
                cuts=tuple(cuts), microbatches=total // s.d, pipeline_schedule=schedule, sync_period=1,
                steps_per_epoch=epoch_steps(ctx.resolved.n_train, s.d, total // s.d * micro),
                batch_size=total // s.d * micro, worker_vcpu=launch.worker_vcpu,
                worker_memory_gb=launch.worker_memory_gb, worker_gpu=x.worker_gpu, offer=x.offer,
                price_per_worker_s=launch.price_per_worker_s, planner_objective_s=point.t_iter_s,
                stage_memory_gb=tuple(o.memory_gb for o in chosen))
    return predicted(launch, plan)


def sized_inputs(x: StrategyInputs, cuts, stage_options: list[SizeOption]) -> StrategyInputs:
    """`x` for a pipeline whose stage i runs on a worker of `stage_options[i]` (cuts after
    profile layer c): each layer at its stage's speed, the price per worker the mean over the
    stages (so workers x price is the plan's bill per second), the launch size the largest."""
    bounds = stage_bounds([c + 1 for c in cuts], len(x.layers))
    factor = [stage_options[i].time_factor for i, (a, b) in enumerate(bounds) for _ in range(a, b + 1)]
    big = max(stage_options, key=lambda o: o.memory_gb)
    return dataclasses.replace(x, layers=tuple({k: (v * f if k in _TIME_KEYS else v) for k, v in l.items()}
                                               for l, f in zip(x.layers, factor)),
                               price_per_worker_s=sum(o.price_per_s for o in stage_options) / len(stage_options),
                               worker_memory_gb=big.memory_gb, worker_vcpu=big.vcpu)


def launched_inputs(ctx, x: StrategyInputs, plan: Plan, profile: dict) -> StrategyInputs:
    """`x` for the sizes `plan`'s stages are launched with (re-planning a co-optimised plan)."""
    if not plan.stage_memory_gb:
        return x
    by_size = {o.memory_gb: o for o in size_options(ctx, x, sorted(set(plan.stage_memory_gb)), profile)}
    return sized_inputs(x, plan.cuts, [by_size[gb] for gb in plan.stage_memory_gb])


def _summary(plan: Plan) -> dict:
    return {"strategy": plan.strategy, "data_parallel": plan.data_parallel, "stages": plan.stages,
            "cuts": list(plan.cuts), "worker_memory_gb": plan.worker_memory_gb,
            "stage_memory_gb": list(plan.stage_memory_gb), "predicted_epoch_s": plan.predicted_epoch_s,
            "predicted_cost_per_epoch_usd": plan.predicted_cost_per_epoch_usd}


def _better(a: Plan, b: Plan, job) -> bool:
    """Whether `a` beats `b` by the job's rule (`planners.co_optimize_flow.select`, the rule
    the co-optimiser chose by) on the flow's predictions per epoch; a tie keeps `b`."""
    n = job.epochs
    chosen, _ = select([Point(p.predicted_epoch_s, p.predicted_cost_per_epoch_usd, p) for p in (b, a)],
                       max_cost=job.budget_usd / n if job.budget_usd else None,
                       max_time=job.deadline_s / n if job.deadline_s else None)
    return chosen.solution is a

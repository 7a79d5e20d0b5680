"""The plan's capacity: the job's `capacity` resolved for one plan (`on_demand`, `spot`, or under
`auto` the cheaper of the two once preemptions are priced: `planners.spot.choose_capacity`).

The interruption rate is the one measured on this target by earlier runs, where one did (the
run terms' cache, `INTERRUPTIONS_KEY`: `coordinator.plan.run_terms`), else the spot offer's
assumed one from the catalog. A plan on spot carries the spot price per worker-second and its
run's bill with the expected re-done work and its warm spares; both bills stay in `Plan.capacity_choice`, which the
dry run and the report show.
"""
from __future__ import annotations

import dataclasses
import statistics

from coordinator.plan.profile_cache import ProfileCache
from coordinator.plan.run_terms import INTERRUPTIONS_KEY, timings_key
from coordinator.run.context import RunContext
from coordinator.workers.preemptions import spot_spares
from core.kinds import Capacity
from core.plan import Plan
from planners.spot import choose_capacity


def measured_interruption_rate(ctx: RunContext) -> float | None:
    """Interruptions per spot worker-hour measured on this target and offer by earlier runs
    (the mean of the run terms' `INTERRUPTIONS_KEY` samples, one per run, or a single number);
    None where none was measured or the cache cannot be read."""
    try:
        doc = ProfileCache(ctx.open_durable).get("timings", timings_key(ctx)) or {}
    except Exception:  # an unreadable cache costs the plan its measured rate, not the run
        return None
    samples = doc.get(INTERRUPTIONS_KEY)
    if samples is None:
        return None
    samples = [float(v) for v in (samples if isinstance(samples, list) else [samples])]
    return statistics.fmean(samples) if samples else None


def with_capacity(ctx: RunContext, plan: Plan, keep: str | None = None) -> Plan:
    """`plan` on the job's capacity: on `spot` (asked, or chosen by `auto`) its worker price is
    the spot offer's and its run's bill is the spot bill with the expected re-done work (the
    coordinator and the store unchanged); on-demand it is unchanged. Where the target has no
    spot offer, `auto` is on-demand and the plan records no choice (`spot` was refused by
    `coordinator.run.validate.check_capacity`). `keep`: the capacity of the plan in force, which
    its re-prediction after an epoch keeps (`auto` chooses once per plan, not once per epoch)."""
    spot, asked = getattr(ctx.resolved, "spot", None), getattr(ctx.job, "capacity", Capacity.ON_DEMAND)
    if spot is None or (asked == Capacity.ON_DEMAND and not getattr(ctx, "dry_run", False)):
        return dataclasses.replace(plan, capacity=str(Capacity.ON_DEMAND))
    measured = measured_interruption_rate(ctx)
    rate = spot.interruptions_per_worker_hour if measured is None else measured
    t = ctx.resolved.target
    od_price = plan.price_per_worker_s
    spot_price = od_price * spot.price_per_s(t.worker_vcpu, t.worker_memory_gb, t.worker_gpu) / \
        ctx.resolved.offer.price_per_s(t.worker_vcpu, t.worker_memory_gb, t.worker_gpu)
    collective = "ring" if "ring" in (ctx.job.collective, getattr(plan, "collective", "")) else "store"
    choice = choose_capacity(asked=keep or asked, workers=plan.workers, run_s=plan.predicted_run_s,
                             epoch_s=plan.predicted_epoch_s, steps_per_epoch=plan.steps_per_epoch,
                             startup_s=float((plan.run_terms or {}).get("startup_s") or 0.0),
                             price_on_demand_per_s=od_price, price_spot_per_s=spot_price,
                             rate_per_worker_hour=rate, rate_measured=measured is not None,
                             strategy=plan.strategy, collective=collective, spot_offer=spot.name,
                             spares=spot_spares(ctx.job, plan),
                             notice_s=spot.notice_s if getattr(ctx.job, "warm", False) else 0.0)
    if keep and asked == Capacity.AUTO:
        choice = dataclasses.replace(choice, reason="auto's choice when the plan was made, kept")
    if choice.capacity != Capacity.SPOT:
        return dataclasses.replace(plan, capacity=choice.capacity, capacity_choice=choice.to_dict())
    run_usd = plan.predicted_run_cost_usd - choice.on_demand_usd + choice.spot_usd
    scale = run_usd / plan.predicted_run_cost_usd if plan.predicted_run_cost_usd else 1.0
    return dataclasses.replace(
        plan, capacity=choice.capacity, capacity_choice=choice.to_dict(), price_per_worker_s=spot_price,
        predicted_cost_per_epoch_usd=plan.predicted_epoch_s * plan.workers * spot_price,
        predicted_run_cost_usd=run_usd,
        predicted_cost_by_epoch_usd=tuple(c * scale for c in plan.predicted_cost_by_epoch_usd))

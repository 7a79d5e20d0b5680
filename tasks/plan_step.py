"""The `plan` and `replan` steps (`coordinator.plan.planning`): choose the parallelism and predict
the run's time and bill; after an epoch, keep the plan in force or switch to a clearly better one.
"""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.plan.planning import make_plan, replan
from coordinator.run.context import RunContext
from coordinator.run.retry import task_options
from core.epoch_summary import Replan
from core.plan import Plan
from planners.calibration import Calibration


@task(name="plan", cache_policy=NO_CACHE, **task_options(retries=1, timeout_s=300))
def choose_plan(ctx: RunContext, profile: dict, workers: int | None = None, calibration: Calibration | None = None,
         epochs_left: int | None = None) -> Plan:
    """Plan the parallelism for `workers` replicas (default: the job's), calibrated by the
    epochs measured so far, for `epochs_left` more epochs (default: the job's)."""
    return make_plan(ctx, profile, workers or ctx.job.workers, calibration, epochs_left)


@task(name="replan", cache_policy=NO_CACHE, **task_options(retries=1, timeout_s=300))
def reconsider_plan(ctx: RunContext, profile: dict, current: Plan, calibration: Calibration, epochs_left: int,
                    budget: int) -> tuple[Plan, Replan]:
    """`replan` as a step of the flow: the decision shows in the UI and the epoch history."""
    chosen, decision = replan(ctx, profile, current, calibration, epochs_left, budget)
    print(f"zooid re-plan after {calibration.epochs} epoch(s): {decision.reason}")
    return chosen, decision

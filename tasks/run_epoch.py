"""The `run_epoch` step (`coordinator.workers.epoch_run`): fan out one worker per replica or stage,
wait, and aggregate their reports; retried as a whole on a transient worker failure."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from coordinator.run.context import RunContext
from coordinator.run.retry import task_options
from coordinator.workers.epoch_run import run_epoch_on_target
from core.plan import Plan


@task(name="run_epoch", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=3600))
def run_epoch(ctx: RunContext, plan: Plan, epoch: int, init: str, lr: float, resume: bool = False,
              on_tick=None) -> dict:
    """Run one epoch on the target. `resume`: the epoch had started under an earlier
    coordinator (continue from its sync checkpoint). `on_tick()` is called while the
    workers train (progress)."""
    attempt = max(0, (task_run.run_count or 1) - 1)  # > 0: workers resume from the sync checkpoint
    return run_epoch_on_target(ctx, plan, epoch, init, lr, resume, attempt, on_tick)

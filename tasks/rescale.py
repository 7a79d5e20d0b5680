"""The `rescale` step (`coordinator.plan.scaling_policy`): the job's scaling policy picks the next
epoch's worker count and learning rate.
"""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.plan import scaling_policy
from coordinator.run.context import RunContext
from coordinator.run.retry import task_options
from core.epoch_summary import EpochSummary, Rescale


@task(name="rescale", cache_policy=NO_CACHE, **task_options(retries=1, timeout_s=120))
def rescale(ctx: RunContext, profile: dict, history: list[EpochSummary], workers: int, lr: float) -> Rescale:
    """The next epoch's worker count and learning rate, within min_workers..max_workers."""
    return scaling_policy.decide_next(ctx, profile, history, workers, lr)



"""The `rescale` step (`coordinator.scaling_policy`): the job's scaling policy picks the next
epoch's worker count and learning rate.
"""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.context import RunContext
from coordinator.retry import task_options
from coordinator import scaling_policy


@task(name="rescale", cache_policy=NO_CACHE, **task_options(retries=1, timeout_s=120))
def rescale(ctx: RunContext, profile: dict, history: list[dict], workers: int, lr: float) -> dict:
    """`{"workers", "lr", "reason"}` for the next epoch, within min_workers..max_workers."""
    return scaling_policy.decide_next(ctx, profile, history, workers, lr)



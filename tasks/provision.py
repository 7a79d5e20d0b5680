"""The `provision` step (`coordinator.workers.staging`): stage the data, write the first reference
checkpoint, check the pool."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.run.context import RunContext
from coordinator.run.retry import task_options
from coordinator.workers.staging import stage_run
from core.plan import Plan


@task(name="provision", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=600))
def provision(ctx: RunContext, plan: Plan, fresh: bool = True) -> dict:
    """Publish the dataset subsets and the initial checkpoint; return the dataset manifest."""
    return stage_run(ctx, plan, fresh)

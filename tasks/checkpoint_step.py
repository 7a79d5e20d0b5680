"""The `checkpoint` step (`coordinator.workers.retention`): confirm the epoch's reference checkpoint
decodes (`save_progress` records it in the history, then prunes)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.run.context import RunContext
from coordinator.run.retry import task_options
from coordinator.workers.retention import commit_checkpoint
from core.epoch_summary import EpochSummary


@task(name="checkpoint", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=300))
def checkpoint(ctx: RunContext, summary: EpochSummary) -> str:
    """Verify the epoch's checkpoint decodes; return its key."""
    return commit_checkpoint(ctx, summary)

"""The `resume` step (`coordinator.run.resume`): where a run goes on, read from the store."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.run.context import RunContext
from coordinator.run.resume import ResumePoint, find_resume_point
from coordinator.run.retry import task_options


@task(name="resume", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=120))
def resume_point(ctx: RunContext, required: bool) -> ResumePoint | None:
    """The run's history, ledger and latest checkpoint in the store (None: it has not started);
    a `resume` that names no run, or another job's, is refused by name and not retried."""
    return find_resume_point(ctx, required=required)

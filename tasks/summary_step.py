"""The `summary` step (`coordinator.report.summary`): the run's summary.json, curves and report,
after the teardown and the final bill."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.report.summary import write_summary
from coordinator.run.context import RunContext
from coordinator.run.job import RunSummary
from coordinator.run.retry import task_options
from core.epoch_summary import EpochSummary


@task(name="summary", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=120))
def summarize(ctx: RunContext, status: str, history: list[EpochSummary], plan: dict, ledger: dict,
              error: str | None) -> RunSummary:
    """Write the run's summary and report (the ledger is final before the report renders it)."""
    return write_summary(ctx, status, history, plan, ledger, error)

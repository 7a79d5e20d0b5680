"""The `save_progress` step (`coordinator.run.resume`, `coordinator.bill.ledger`): after every
epoch, the history and the bill so far in the store, so a killed coordinator leaves both behind."""
from __future__ import annotations

from contextlib import closing

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.bill.ledger import record_cost_now
from coordinator.run.context import RunContext
from coordinator.run.resume import write_history
from coordinator.run.retry import task_options
from core.epoch_summary import EpochSummary


@task(name="save_progress", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=120))
def save_progress(ctx: RunContext, history: list[EpochSummary]) -> None:
    """Rewrite the run's history and its ledger so far (not final); both are whole documents,
    so a retry writes the same again."""
    with closing(ctx.open_durable()) as store:
        write_history(store, ctx.run_id, history)
    record_cost_now(ctx, final=False)

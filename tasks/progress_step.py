"""The `save_progress` step (`coordinator.run.resume`, `coordinator.workers.retention`,
`coordinator.bill.ledger`): after every epoch, the history in the store (its last epoch's
checkpoint is where a resume goes on), then the checkpoints it no longer needs pruned, then
the bill so far, so a killed coordinator leaves both behind."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.bill.ledger import record_cost_now
from coordinator.run.context import RunContext
from coordinator.run.retry import task_options
from coordinator.workers.retention import record_history
from core.epoch_summary import EpochSummary


@task(name="save_progress", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=120))
def save_progress(ctx: RunContext, history: list[EpochSummary]) -> None:
    """Rewrite the run's history, prune behind its last epoch, rewrite the ledger so far (not
    final); the documents are whole and a pruning deletes what is gone already, so a retry does
    the same again."""
    record_history(ctx, history)
    record_cost_now(ctx, final=False)

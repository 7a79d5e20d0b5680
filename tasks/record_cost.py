"""The `record_cost` step (`coordinator.bill.ledger`): close the coordinator's interval, write the
ledger, show the bill."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.bill.ledger import record_final_bill
from coordinator.run.context import RunContext


@task(name="record_cost", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, timeout_seconds=120)
def record_cost(ctx: RunContext, writes_after: int = 0) -> dict:
    """Write the final ledger and a table artifact of it (before the report, which shows it);
    `writes_after`: the puts the run makes after it, which it bills (`record_cost_now`)."""
    return record_final_bill(ctx, writes_after)

"""The `record_cost` step: close the coordinator's interval, write the ledger, show the bill."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.context import RunContext
from coordinator.ledger import record_cost_now


@task(name="record_cost", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, timeout_seconds=120)
def record_cost(ctx: RunContext) -> dict:
    """Write the final ledger and a table artifact of it (before the report, which shows it)."""
    from prefect.artifacts import create_table_artifact

    from coordinator.progress import money
    from coordinator.report import artifact_key

    ledger = record_cost_now(ctx)
    create_table_artifact(key=artifact_key(ctx.run_id, "ledger"), table=[
        {k: r[k] for k in ("resource", "kind", "offer", "status", "seconds", "unit_price_per_s", "usd")}
        for r in ledger["rows"]], description=f"Cost ledger of run {ctx.run_id}: {money(ledger['total_usd'])}")
    return ledger

"""The run's bill now: the ledger, the live warm workers' open intervals and the coordinator's
interval so far, written to the run's ledger (`coordinator.bill.cost`).
"""
from __future__ import annotations

import time

from prefect.artifacts import create_table_artifact

from comm.store_base import process_ops
from coordinator.bill.cost import coordinator_record, store_records, total_usd, write_ledger
from coordinator.run.context import RunContext
from core.formats import money
from core.keys import artifact_key
from core.store_ops import StoreOps, grouped_total


def rows_now(ctx: RunContext, to_come: dict | None = None) -> list:
    """The bill up to now: the ledger, the live warm workers' open intervals, the
    coordinator's interval so far, and the store's requests (`store_ops_now`) and server."""
    now = time.time()
    rows = list(ctx.state.ledger) + (ctx.state.warm.open_rows() if ctx.state.warm is not None else [])
    rows.append(coordinator_record(ctx.run_id, ctx.started_at, now, ctx.coordinator_offer,
                                   ctx.price_per_coordinator_s))
    rows += store_records(ctx.run_id, store_ops_now(ctx, to_come), ctx.started_at, now, ctx.resolved.offer.provider)
    return rows


def store_ops_now(ctx: RunContext, to_come: dict | None = None) -> dict[str, dict[str, StoreOps]]:
    """The run's store requests so far by party and store (`{party: {Store.where: StoreOps}}`):
    the workers' reports, and the requests this process made since the run began plus
    `to_come` (`{where: StoreOps}` it is about to make) as the coordinator's."""
    began = ctx.state.process_ops_at_start
    coordinator = grouped_total([{where: ops - began.get(where, StoreOps()) for where, ops in process_ops().items()},
                                 to_come or {}])
    return {"workers": dict(ctx.state.store_ops), "coordinator": coordinator}


def record_cost_now(ctx: RunContext, final: bool = True, writes_after: int = 0) -> dict:
    """Write the ledger with the coordinator's interval up to now; returns the ledger doc.
    `final`: the run's last bill (its coordinator interval closes here); written once. A final
    ledger bills its own put and the `writes_after` puts the coordinator makes after it (the
    summary and its curves: one small object each, one request), which no later ledger can."""
    store = ctx.open_durable()
    try:
        rows = rows_now(ctx, {store.where: StoreOps(put=1 + writes_after)} if final else None)
        write_ledger(store, ctx.run_id, rows, final=final)
    finally:
        store.close()
    if final:
        ctx.state.cost_recorded = True
    return {"run_id": ctx.run_id, "total_usd": total_usd(rows), "final": final,
            "rows": [r.to_dict() for r in rows]}


def record_final_bill(ctx: RunContext, writes_after: int = 0) -> dict:
    """Write the run's final ledger (`writes_after`: `record_cost_now`'s) and a table artifact of
    it; returns the ledger doc."""
    ledger = record_cost_now(ctx, writes_after=writes_after)
    create_table_artifact(key=artifact_key(ctx.run_id, "ledger"), table=[
        {k: r[k] for k in ("resource", "kind", "offer", "status", "seconds", "unit_price_per_s", "usd")}
        for r in ledger["rows"]], description=f"Cost ledger of run {ctx.run_id}: {money(ledger['total_usd'])}")
    return ledger

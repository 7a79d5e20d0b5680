"""Failure, crash and cancellation hooks of the `train` flow: nothing leaks, nothing goes unbilled.

When the hook runs in the coordinator's process, the run's context is still in memory and the
normal teardown and cost steps are reused. When it runs elsewhere (Prefect runs cancellation
hooks of a deployment run in the runner process), the run is rebuilt from what is durable:
the run id derives from the flow run id, the job from the flow run's parameters, and the
ledger so far from the store. A ledger the coordinator already wrote as final (before its
report) is never rewritten, so the report and cost.json agree whatever ended the run.
"""
from __future__ import annotations

import json
import time

from blocks.compute import resolve_target
from clouds.registry import adapter_for
from coordinator.bill.cost import coordinator_record, is_final, write_ledger
from coordinator.bill.ledger import record_cost_now
from coordinator.run.context import ACTIVE, run_id_for
from coordinator.run.job import TrainJob
from coordinator.run.job_fields import job_from_fields
from coordinator.run.stores import open_checked_store, resolve_durable_ref, resolve_store_ref
from coordinator.workers.cleanup import cancel_flow_runs, delete_scratch, finish_cancelled, store_roles, teardown_run
from coordinator.workers.sweep import sweep_run
from core.coordinator_size import SMALLEST_GB
from core.cost_record import CostRecord
from core.errors import ZooidValueError
from core.keys import ledger_key, run_prefix, summary_key
from planners.catalog import get_offer


def _job_from_parameters(parameters: dict):
    params = dict(parameters or {})
    if "job" in params:
        job = params["job"]
        return job if isinstance(job, TrainJob) else TrainJob(**job)
    return job_from_fields(params)


def _rebuild_and_clean(flow_run, state) -> None:
    run_id = run_id_for(flow_run.id)
    try:
        cancelled = cancel_flow_runs(run_id)
    except Exception:
        cancelled = []
    sweep_run(run_id)
    try:
        finish_cancelled(cancelled)
    except Exception:
        pass
    try:
        job = _job_from_parameters(flow_run.parameters)
    except ZooidValueError:  # refused as the job was built: nothing was provisioned
        return
    try:
        target = resolve_target(job.target)
    except ValueError:  # an unknown target: refused before anything was provisioned on it
        return
    adapter = adapter_for(target)
    if adapter is not None:
        adapter.sweep(run_id)
    offer = get_offer(target.coordinator_offer or job.offer or target.offer)  # the coordinator's: on-demand, no GPU
    price = offer.price_per_s(target.coordinator_vcpu, target.coordinator_memory_gb or SMALLEST_GB, 0)
    scratch_ref = resolve_store_ref(job.store)
    durable_ref = resolve_durable_ref(job.durable_store, scratch_ref)
    if scratch_ref != durable_ref:
        scratch = open_checked_store(scratch_ref)
        try:
            delete_scratch(scratch, run_id, "store")
        finally:
            scratch.close()
    store = open_checked_store(durable_ref)
    try:
        if not cancelled and not store.list(run_prefix(run_id) + "/"):  # refused before anything was provisioned
            return
        delete_scratch(store, run_id, store_roles(scratch_ref, durable_ref)[durable_ref])
        doc = json.loads(store.get(ledger_key(run_id))) if store.exists(ledger_key(run_id)) else None
        if is_final(doc):  # the coordinator billed itself and rendered its report: leave both as they are
            return
        rows = []
        if doc is not None:
            fields = CostRecord.__dataclass_fields__
            rows = [CostRecord(**{k: v for k, v in r.items() if k in fields})
                    for r in doc["rows"] if r["kind"] != "coordinator"]
            billed = [r for r in doc["rows"] if r["kind"] == "coordinator"]
            if billed:  # the size the run resolved for its model (`core.coordinator_size`)
                offer, price = get_offer(billed[-1]["offer"]), float(billed[-1]["unit_price_per_s"])
        start = flow_run.start_time.timestamp() if flow_run.start_time else time.time()
        rows.append(coordinator_record(run_id, start, time.time(), offer, price))
        write_ledger(store, run_id, rows, final=True)
        summary = summary_key(run_id)
        if not store.exists(summary):
            store.put(summary, json.dumps({"run_id": run_id, "status": end_status(state),
                                               "error": state.message, "epochs": [],
                                               "total_cost_usd": sum(r.usd for r in rows)}).encode())
    finally:
        store.close()


def end_status(state) -> str:
    """A run's status for a Prefect end state: `cancelled` for Cancelling and Cancelled (the
    runner hands its cancellation hooks the Cancelling state), else `failed`."""
    kind = getattr(getattr(state, "type", None), "value", "")
    return "cancelled" if kind in ("CANCELLING", "CANCELLED") else "failed"


def on_abnormal_end(flow, flow_run, state) -> None:
    """Tear the run down and record its cost after a failure, crash or cancellation."""
    ctx = ACTIVE.get(str(flow_run.id))
    try:
        if ctx is not None:
            if not ctx.state.torn_down:
                teardown_run(ctx)
            if not ctx.state.cost_recorded:
                record_cost_now(ctx)
            return
        _rebuild_and_clean(flow_run, state)
    except Exception as exc:  # a hook must not hide the run's own error
        print(f"zooid: cleanup after {state.type.value} of {flow_run.id} failed: {exc}")

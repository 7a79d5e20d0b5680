"""Stopping everything a run started: its workers (launchers, warm pool, processes tagged with
its id), the worker flow runs of pool targets, the cloud resources through the target's adapter
(billed from the provider's clock before the sweep), and its scratch keys. Idempotent.
"""
from __future__ import annotations

from blocks.store_refs import open_store_ref
from clouds.registry import adapter_for
from coordinator.run.context import RunContext
from coordinator.workers.epoch_run import bill_from_cloud_clock
from coordinator.workers.sweep import sweep_run
from core.keys import scratch_prefixes
from core.kinds import TargetKind


def cancel_flow_runs(run_id: str) -> list:
    """Cancel the run's worker flow runs that are not final; return them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.states import Cancelling

    cancelled = []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"zooid-run:{run_id}"])))
        for fr in runs:
            if fr.state is not None and not fr.state.is_final():
                client.set_flow_run_state(fr.id, Cancelling(message="zooid teardown"), force=True)
                cancelled.append(fr)
    return cancelled


def finish_cancelled(flow_runs: list) -> None:
    """Mark as Cancelled the worker flow runs whose processes the sweep already stopped (the
    process worker would otherwise leave them Cancelling, having nothing left to kill)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        for fr in flow_runs:
            state = client.read_flow_run(fr.id).state
            if state is not None and not state.is_final():
                client.set_flow_run_state(fr.id, Cancelled(message="zooid teardown: worker stopped"), force=True)


def delete_scratch(store, run_id: str, role: str = "both") -> int:
    """Delete the run's scratch keys on a store of `role` (`core.keys.scratch_prefixes`: the
    workers' records too on a run's store that is not its durable one); keep checkpoints,
    summary, ledger and report."""
    return sum(store.delete_prefix(p) for p in scratch_prefixes(run_id, role))


def store_roles(store_ref: str, durable_ref: str) -> dict[str, str]:
    """The run's stores by reference, each with its `scratch_prefixes` role."""
    if store_ref == durable_ref:
        return {store_ref: "both"}
    return {store_ref: "store", durable_ref: "durable"}


def _step(report: dict, name: str, fn):
    """Run one teardown step: its failure is reported under `report["errors"][name]` and
    printed on one line, and the next step runs all the same. Returns `fn()`, or None."""
    try:
        return fn()
    except Exception as exc:  # the API may be gone when the run crashed with it
        report["errors"][name] = f"{type(exc).__name__}: {exc}"
        print(f"zooid: teardown {name} failed: {type(exc).__name__}: {exc}")
        return None


def teardown_run(ctx: RunContext) -> dict:
    """Stop workers and the run's fork server, cancel worker flow runs, delete scratch keys. Safe to
    call twice.

    On a cloud target the steps cancel, stop, bill and sweep each run even when an earlier
    one failed (a billing error must not leak the run's cloud resources); each failure is in
    `report["errors"]` under its step's name."""
    report = {"stopped_pids": [], "cancelled_flow_runs": 0, "deleted_keys": 0, "errors": {}}
    if ctx.state.warm is not None:
        ctx.state.warm.stop_all("run torn down")
    for launcher in list(ctx.state.launchers):
        launcher.stop("run torn down")
    ctx.state.launchers.clear()
    if ctx.state.forks is not None:  # the run's fork server (inline workers), once they are stopped
        ctx.state.forks.close()
    target = ctx.resolved.target
    cancelled = []
    if target.remote:
        cancelled = _step(report, "cancel", lambda: cancel_flow_runs(ctx.run_id)) or []
        report["cancelled_flow_runs"] = len(cancelled)
        adapter = adapter_for(target)
        if adapter is not None:
            report["stopped"] = _step(report, "stop", lambda: adapter.stop(cancelled)) or []
            report["stopped"] += _step(report, "settle", lambda: adapter.settle(ctx.run_id)) or []
            # ACI's sweep deletes container groups: read their clock first
            _step(report, "bill", lambda: bill_from_cloud_clock(ctx, [], -1))
            swept = _step(report, "sweep", lambda: adapter.sweep(ctx.run_id))
            if swept is not None:
                report["swept"] = swept
    report["stopped_pids"] = sweep_run(ctx.run_id)
    if target.kind == TargetKind.PROCESS and cancelled:
        _step(report, "finish_cancelled", lambda: finish_cancelled(cancelled))
    cancel_errors = [report["errors"][k] for k in ("cancel", "finish_cancelled") if k in report["errors"]]
    if cancel_errors:
        report["cancel_error"] = cancel_errors[0]
    if ctx.state.provisioned:
        for ref, role in store_roles(ctx.store_ref, ctx.durable_ref).items():  # data lives on the durable one
            store = open_store_ref(ref)
            try:
                report["deleted_keys"] += delete_scratch(store, ctx.run_id, role)
            finally:
                store.close()
    ctx.state.torn_down = True
    return report

"""The run's summary: `runs/<run_id>/summary.json`, its curves and the report artifact, written
once the run is torn down and billed (the report renders the final ledger)."""
from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from coordinator.bill.cost import spot_tally, worker_seconds
from coordinator.report.report import markdown_report, plot_curves
from coordinator.run.context import RunContext
from coordinator.run.job import RunSummary
from core.epoch_summary import EpochSummary, run_token_figures
from core.keys import artifact_key, report_key, summary_key


def write_summary(ctx: RunContext, status: str, history: list[EpochSummary], plan: dict, ledger: dict,
                  error: str | None) -> RunSummary:
    """The summary of a run that ended `status` (`error`: what stopped it) after `history`, its
    first `plan` and its final `ledger`, written to the store with its curves, and the report
    artifact; written whole, so writing it again writes the same."""
    last = history[-1] if history else None
    summary = RunSummary(
        run_id=ctx.run_id, status=status, final_loss=last.loss if last else None,
        final_accuracy=last.val_accuracy if last else None, total_cost_usd=ledger["total_usd"], plan=plan,
        epochs=history, store_url=ctx.durable_ref, checkpoint_key=last.checkpoint_key if last else "", error=error,
        worker_seconds=worker_seconds(ledger["rows"]), spot=spot_tally(ledger["rows"]), final_perplexity=last.val_perplexity if last else None,
        final_token_accuracy=last.val_token_accuracy if last else None,
        **run_token_figures(history, ledger["total_usd"]))
    png = plot_curves(summary.epochs) if summary.epochs else None
    store = ctx.open_durable()
    try:
        store.put(summary_key(ctx.run_id), summary.model_dump_json(indent=1).encode())
        if png:
            store.put(report_key(ctx.run_id, "curves.png"), png)
    finally:
        store.close()
    create_markdown_artifact(key=artifact_key(ctx.run_id, "report"),
                             markdown=markdown_report(summary, ledger["rows"], png),
                             description=f"Plan, epochs and bill of run {ctx.run_id}")
    return summary

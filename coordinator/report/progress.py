"""What a person watching a run reads: one line per epoch in the coordinator's log, and the
few lines a command-line run prints when it is stopped.

Pure formatting: money in dollars to 3 significant digits ($0.000592, $1.23), times with
their unit; no Prefect, no store.
"""
from __future__ import annotations

from core.epoch_summary import EpochSummary
from core.formats import duration as seconds
from core.formats import money


def epoch_line(e: EpochSummary, epochs: int, cost_so_far_usd: float, predicted_run_cost_usd: float | None) -> str:
    """The coordinator's line for one finished epoch: epoch i/N, workers, loss, accuracy (for
    token targets: perplexity, token accuracy and tokens per second), seconds against the
    plan's prediction, and the bill so far against what the plan in force predicted by the end
    of this epoch (`predicted_cost_so_far_usd`) and for the whole run."""
    head = f"epoch {e.epoch + 1}/{epochs}:"
    parts = [f"{e.workers} worker(s)" + (f" x {e.stages} stage(s)" if e.stages > 1 else ""), f"loss {e.loss:.4g}"]
    if e.val_accuracy is not None:
        parts.append(f"accuracy {100 * e.val_accuracy:.1f}%")
    if e.val_perplexity is not None:
        parts.append(f"perplexity {e.val_perplexity:.4g}")
    if e.val_token_accuracy is not None:
        parts.append(f"token accuracy {100 * e.val_token_accuracy:.1f}%")
    if e.tokens:
        parts.append(f"{e.tokens_per_s:,.0f} tokens/s")
    took = seconds(e.seconds)
    if e.predicted_epoch_s:
        took += f" (predicted {seconds(e.predicted_epoch_s)})"
    parts.append(took)
    cost = f"cost so far {money(cost_so_far_usd)}"
    by_now = e.predicted_cost_so_far_usd
    said = [f"predicted {money(by_now)} by now"] if by_now else []
    if predicted_run_cost_usd:
        said.append(f"{money(predicted_run_cost_usd)} for the run")
    if said:
        cost += f" ({'; '.join(said)})"
    parts.append(cost)
    return head + " " + ", ".join(parts)


def interrupted_lines(signal_name: str, run_id: str | None, torn_down: dict | None, bill_usd: float | None,
                      ledger_at: str | None, resume_args: str) -> list[str]:
    """At most three lines for a command-line run stopped by a signal: what was torn down,
    the bill so far, and how to resume."""
    if run_id is None:  # stopped before the run began: nothing was rented
        return [f"{signal_name}: stopped before the run began; nothing was started or billed"]
    torn_down = torn_down or {}
    stopped = torn_down.get("workers")
    what = (f"{stopped} worker(s) and the coordinator stopped" if stopped is not None
            else "the run's workers and the coordinator stopped")
    lines = [f"{signal_name}: run {run_id} torn down: {what}, scratch keys deleted, nothing left running"]
    if bill_usd is not None:
        lines.append(f"bill so far: {money(bill_usd)}" + (f" (ledger: {ledger_at})" if ledger_at else ""))
    else:
        lines.append("bill so far: not recorded (the store could not be written)")
    lines.append(f"resume with: python -m flows.train {resume_args}--param resume={run_id}".replace("  ", " "))
    return lines

"""Whether a Local-SGD epoch trained every sample exactly once: its workers' history records
(`engine.local_sgd_epoch.read_epoch_history`, on the run's store) add up, by count and
order-independent digest of sample ids, to the dataset's (`engine.replica_data.epoch_coverage`);
a resumed epoch's records count the earlier phases they continued too.
"""
from __future__ import annotations

from coordinator.run.context import RunContext
from core.epoch_summary import EpochSummary
from core.errors import ZooidValueError
from core.kinds import Strategy
from core.plan import Plan
from engine.local_sgd_epoch import read_epoch_history
from engine.replica_data import dataset_tally, epoch_coverage


def check_samples(ctx: RunContext, plan: Plan, summary: EpochSummary) -> EpochSummary:
    """`summary` with `samples_once` set for a Local-SGD epoch (printing a line when it is
    False); a pipeline's is left None (its workers keep no history records), and so is one whose
    records do not make a whole world on a store that a restart may empty (`Store.keeps_keys`)."""
    if plan.strategy != Strategy.LOCAL_SGD:
        return summary
    store = ctx.open_store()
    try:
        records, keeps_keys = read_epoch_history(store, ctx.run_id, summary.epoch), store.keeps_keys
    finally:
        store.close()
    try:
        summary.samples_once = epoch_coverage(records) == dataset_tally(int(ctx.state.dataset["n_train"]))
    except ZooidValueError as exc:
        if not keeps_keys:  # a restart may have emptied it (Redis without persistence): unknown, not wrong
            print(f"zooid: epoch {summary.epoch}: not checked, the run's store may have lost records ({exc})")
            summary.samples_once = None
            return summary
        print(f"zooid: epoch {summary.epoch}: {exc}")
        summary.samples_once = False
    if not summary.samples_once:
        print(f"zooid: epoch {summary.epoch}: the workers' records do not add up to every sample once")
    return summary

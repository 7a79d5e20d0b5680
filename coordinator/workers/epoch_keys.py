"""An epoch attempt's fresh start on the stores: no worker of it may read a failed attempt's
sync slices or activations, nor continue a failed attempt's handover (its peers start from the
sync checkpoint). Cleared before the attempt's workers start: at the epoch's send, or before
pre-started workers are launched (`coordinator.workers.warm_prestart.PrestartWatch`), which may
begin the epoch while the coordinator still commits the one before.
"""
from __future__ import annotations

from coordinator.run.context import RunContext
from core.keys import activation_prefix, handover_key, sync_prefix
from core.plan import Plan


def clear_epoch_keys(ctx: RunContext, epoch: int, plan: Plan) -> None:
    """Delete epoch `epoch`'s sync slices and, for a pipeline (the only plan that writes them), its
    activations (run store), and the handovers of the attempt's ranks (durable store), each by its
    key: a rank reads its own handover only, and a cloud store bills a listing (S3, Azure) where
    it does not bill a delete."""
    store = ctx.open_store()
    try:
        store.delete_prefix(sync_prefix(ctx.run_id, epoch) + "/")
        if plan.stages > 1:
            store.delete_prefix(activation_prefix(ctx.run_id, epoch) + "/")
    finally:
        store.close()
    durable = ctx.open_durable()
    try:
        for rank in range(plan.data_parallel):
            durable.delete(handover_key(ctx.run_id, epoch, rank))
    finally:
        durable.close()

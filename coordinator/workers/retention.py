"""Committing an epoch's checkpoint: confirm the epoch's reference checkpoint, then, once the
run's history records the epoch, keep only the checkpoints the job asked for.

Rank 0 wrote the averaged model and optimizer state in one atomic put; `commit_checkpoint`
reads it back (it must decode). The run's history (`coordinator.run.resume.write_history`,
rewritten atomically after each epoch) is what a resume reads: its last epoch's
`checkpoint_key` is the latest complete checkpoint, so no pointer of its own is written.
`retire_checkpoints` runs after that write: the last `keep_checkpoints` epoch checkpoints stay,
and the best by validation loss (`ckpt/best.json`) when the job has a target; the mid-epoch
sync checkpoints of finished epochs go (a resume starts after the latest epoch). A kill between
the history's write and the pruning leaves more checkpoints, never fewer, and a kill before the
write resumes from the epoch before, whose checkpoint is still there. The keys to prune are
listed once per coordinator and then known (`known_checkpoints`), so an epoch on S3 or Azure
pays no listing.
"""
from __future__ import annotations

import json
from typing import Iterable

from comm.store import Store
from comm.tensor_codec import read_header
from coordinator.run.context import RunContext
from coordinator.run.resume import write_history
from core.epoch_summary import EpochSummary
from core.keys import EPOCH_CHECKPOINT, RESIDUAL, SYNC_CHECKPOINT, best_key, checkpoint_prefix, sync_checkpoint_key


def update_best(store, run_id: str, epoch: int, key: str, val_loss: float | None) -> dict | None:
    """Record `key` as the best checkpoint when its validation loss beats the best so far;
    return the best record (None when no epoch reported a validation loss)."""
    doc = json.loads(store.get(best_key(run_id))) if store.exists(best_key(run_id)) else None
    if val_loss is not None and (doc is None or val_loss < doc["val_loss"]):
        doc = {"epoch": epoch, "key": key, "val_loss": val_loss}
        store.put(best_key(run_id), json.dumps(doc).encode())
    return doc


def prune_checkpoints(store, run_id: str, latest_epoch: int, keep: int, best: dict | None = None,
                      keys: Iterable[str] | None = None) -> list[str]:
    """Delete epoch checkpoints older than the last `keep` (up to `latest_epoch`), except the
    best one (with the error-feedback residuals each names), and the sync checkpoints of epochs
    up to `latest_epoch`; return the deleted keys. `keys`: the run's checkpoint keys where the
    caller knows them (None: listed)."""
    keys = store.list(checkpoint_prefix(run_id) + "/") if keys is None else sorted(keys)
    epochs = sorted(int(m.group(1)) for k in keys
                    if (m := EPOCH_CHECKPOINT.search(k)) and int(m.group(1)) <= latest_epoch)
    keep_epochs = set(epochs[-keep:]) | ({best["epoch"]} if best else set())
    deleted = []
    for k in keys:
        # a replica's error-feedback residuals (`engine.residuals`) are kept while their epoch's checkpoint is
        epoch_match, sync_match = EPOCH_CHECKPOINT.search(k) or RESIDUAL.search(k), SYNC_CHECKPOINT.search(k)
        if ((epoch_match and int(epoch_match.group(1)) <= latest_epoch
             and int(epoch_match.group(1)) not in keep_epochs)
                or (sync_match and int(sync_match.group(1)) <= latest_epoch)):
            store.delete(k)
            deleted.append(k)
    return deleted


def known_checkpoints(ctx: RunContext, epoch: int, key: str) -> set[str] | None:
    """The run's checkpoint keys after epoch `epoch` wrote `key`, where this coordinator knows
    them without a listing (a durable store bills one like a write): those its last pruning left,
    this epoch's checkpoint and sync checkpoint (a delete of a key never written costs nothing on
    S3 or Azure). None, to be listed: at the coordinator's first epoch (a resumed run's keys are
    its predecessor's) and where workers write their own error-feedback residuals."""
    if ctx.state.checkpoint_keys is None or ctx.job.sync_dtype != "float32":
        return None
    return ctx.state.checkpoint_keys | {key, sync_checkpoint_key(ctx.run_id, epoch)}


def commit_checkpoint(ctx: RunContext, summary: EpochSummary) -> str:
    """Verify the epoch's checkpoint (`summary.checkpoint_key`) decodes; return its key."""
    store = ctx.open_durable()
    try:
        if not read_header(store.get(summary.checkpoint_key, timeout=30)):
            raise RuntimeError(f"checkpoint {summary.checkpoint_key} has no header")
    finally:
        store.close()
    return summary.checkpoint_key


def record_history(ctx: RunContext, history: list[EpochSummary]) -> None:
    """Rewrite the run's history (its last epoch's checkpoint is where a resume goes on), then
    retire behind its last epoch (`retire_checkpoints`), through one client of the durable store."""
    store = ctx.open_durable()
    try:
        write_history(store, ctx.run_id, history)
        if history:
            retire_checkpoints(ctx, history[-1], store)
    finally:
        store.close()


def retire_checkpoints(ctx: RunContext, summary: EpochSummary, store: Store | None = None) -> None:
    """After the history recorded epoch `summary.epoch`: record the best checkpoint (a job with a
    target), prune what the job keeps no longer (through `store`, the run's durable store; None:
    a client of its own)."""
    job, epoch, key = ctx.job, summary.epoch, summary.checkpoint_key
    own = store is None
    store = ctx.open_durable() if own else store
    try:
        targeted = job.target_loss is not None or job.target_accuracy is not None
        best = update_best(store, ctx.run_id, epoch, key, summary.val_loss) if targeted else None
        keys = known_checkpoints(ctx, epoch, key)
        if keys is None:
            keys = set(store.list(checkpoint_prefix(ctx.run_id) + "/"))
        ctx.state.checkpoint_keys = keys - set(prune_checkpoints(store, ctx.run_id, epoch, job.keep_checkpoints,
                                                                 best, keys=keys))
    finally:
        if own:
            store.close()

"""The `checkpoint` step: confirm the epoch's reference checkpoint and point `latest` at it.

Rank 0 wrote the averaged model and optimizer state in one atomic put; this step reads it
back (it must decode), then writes `runs/<run_id>/ckpt/latest.json`, also atomically, so a
resume always finds a complete checkpoint.
"""
from __future__ import annotations

import json
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RunContext
from tasks.retry import task_options


def latest_key(run_id: str) -> str:
    return f"runs/{run_id}/ckpt/latest.json"


@task(name="checkpoint", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=300))
def checkpoint(ctx: RunContext, epoch: int, key: str, metrics: dict) -> str:
    """Verify `key` decodes as a checkpoint and record it as the latest; return the key."""
    from training.tensor_codec import read_header

    store = ctx.open_durable()
    try:
        header = read_header(store.get(key, timeout=30))
        if not header:
            raise RuntimeError(f"checkpoint {key} has no header")
        store.put(latest_key(ctx.run_id), json.dumps(
            {"epoch": epoch, "key": key, "written_at": time.time(),
             "val_accuracy": metrics.get("val_accuracy"), "val_loss": metrics.get("val_loss")}).encode())
    finally:
        store.close()
    return key

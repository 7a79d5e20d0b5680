"""The `worker` flow: one worker's share of one epoch, run on a work pool.

It receives a `WorkerSpec` as a JSON dict, trains, and returns a `WorkerResult` dict:
metrics, timings and store keys, never tensors. The result is persisted as JSON (not
pickle) in result storage that the coordinator can read.
"""
from __future__ import annotations

from prefect import flow


def run_worker(spec_dict: dict) -> dict:
    """Run one WorkerSpec against its store and return the WorkerResult as a dict."""
    from blocks.store import open_store_ref
    from training.specs import WorkerSpec
    from training.run_spec import run_spec

    spec = WorkerSpec.from_dict(spec_dict)
    store = open_store_ref(spec.store_url)
    try:
        return run_spec(spec, store).to_dict()
    finally:
        store.close()


@flow(name="worker", persist_result=True, result_serializer="json", log_prints=True)
def worker(spec: dict) -> dict:
    """Train one replica (or stage) for one epoch and report metrics and keys."""
    return run_worker(spec)

"""Staging a run: stage the data, write the first reference checkpoint, check the pool.

Local targets need nothing rented; pool targets need their worker deployment to exist (a
clear error otherwise, before any worker is started). Every key written lives under
`runs/<run_id>/` (`core.keys`).
"""
from __future__ import annotations

import json
import time

from coordinator.run.context import RunContext
from coordinator.run.job_data import is_prepared, publish_job_dataset, read_prepared_manifest
from coordinator.workers.sweep import sweep_orphans
from core.errors import ZooidValueError
from core.keys import data_manifest_key, init_checkpoint_key, run_doc_key
from core.plan import Plan
from engine.checkpoint import initial_checkpoint
from engine.datasets import read_manifest


def check_deployment(name: str) -> None:
    """Raise ZooidValueError("target") when the worker deployment is not registered."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(name)
    except Exception as exc:
        raise ZooidValueError("target", f"worker deployment {name!r} not found on the Prefect API "
                              f"({type(exc).__name__}); start the stack with `make up`") from None


def stage_run(ctx: RunContext, plan: Plan, fresh: bool = True) -> dict:
    """Publish the dataset subsets and the initial checkpoint (a resumed run republishes the
    data only if teardown removed it, and keeps its checkpoints; a prepared dataset is read where
    it is, its manifest only); return the dataset's manifest, without its per-shard checksums
    (the workers read those from the manifest itself)."""
    sweep_orphans()  # workers of coordinators that died earlier must not train on
    target = ctx.resolved.target
    if target.remote:
        check_deployment(target.worker_deployment)
    store = ctx.open_durable()
    try:
        if is_prepared(ctx.job.dataset):  # the workers read its shards where they are: nothing is copied
            manifest = read_prepared_manifest(ctx.job.dataset)
        elif not fresh and store.exists(data_manifest_key(ctx.run_id)):
            manifest = read_manifest(store, ctx.run_id)
        else:  # the split is deterministic, so a republished subset i is the same subset i
            manifest = publish_job_dataset(store, ctx.run_id, ctx.job, ctx.resolved.subset_size)
        ctx.state.dataset = {k: v for k, v in manifest.to_dict().items() if k != "shards"}
        init = init_checkpoint_key(ctx.run_id)
        if fresh or not store.exists(init):
            initial_checkpoint(store, init, ctx.job.model, ctx.job.optimizer, ctx.job.lr,
                               seed=ctx.job.seed, model_kwargs=ctx.resolved.model_kwargs, meta={"run_id": ctx.run_id})
        run_doc = {"run_id": ctx.run_id, "flow_run_id": ctx.flow_run_id, "job": ctx.job.model_dump(),
                   "plan": plan.to_dict(), "target": ctx.job.target, "dataset": ctx.state.dataset,
                   "started_at": ctx.started_at, "provisioned_at": time.time()}
        if fresh or not store.exists(run_doc_key(ctx.run_id)):
            store.put(run_doc_key(ctx.run_id), json.dumps(run_doc, indent=1).encode())
    finally:
        store.close()
    ctx.state.provisioned = True
    return ctx.state.dataset

"""The `worker` flow: one worker on a work pool.

It receives a `WorkerSpec` as a JSON dict. A cold worker (the default spec) trains one
epoch and returns its `WorkerResult` dict: metrics, timings and store keys, never tensors,
persisted as JSON (not pickle) in result storage that the coordinator can read.

A spec `{"prepare_cut": ...}` writes one cut of a `prepare` flow's files-of-arrays source
instead (`engine.array_cuts.run_cut_job`; `flows.prepare_cuts` starts it) and returns what it
wrote, as JSON: a prepare's cuts run on the same pools and deployments as training's workers.

A warm worker (`spec["warm"]` set, `runtime.warm`) lives across epochs: the flow run
serves the coordinator's commands from the store until it is stopped or its lease expires,
and every epoch it trains is a `train_epoch` task run of this flow run, with its own state
and logs in the UI. A lease that expires fails the flow run with the reason.
"""
from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from blocks.store_refs import open_store_ref
from core.specs import WorkerResult, WorkerSpec
from engine import preemption

CUT_SPEC = "prepare_cut"
"""The key of a spec that makes this flow's run write one cut of a prepare (`flows.prepare_cuts`)."""


def run_worker(spec_dict: dict) -> dict:
    """Run one WorkerSpec against its store and return the WorkerResult as a dict."""
    # torch: Prefect loads this module to read the flow's parameters; the epoch loads torch
    from runtime.run_spec import run_spec

    spec = WorkerSpec.from_dict(spec_dict)
    store = open_store_ref(spec.store_url)
    try:
        return run_spec(spec, store, open_store_ref).to_dict()
    finally:
        store.close()


@task(name="train_epoch", cache_policy=NO_CACHE, result_serializer="json", persist_result=False,
      task_run_name="epoch {spec[epoch]} rank {spec[rank]} attempt {spec[attempt]}")
def train_epoch(spec: dict) -> dict:
    """One epoch of a warm worker (relaunching is the coordinator's call, so no retries)."""
    return run_worker(spec)


def serve_warm(spec_dict: dict) -> dict:
    """Serve the run's epochs until the coordinator stops this worker."""
    # torch: Prefect loads this module to read the flow's parameters; the epoch loads torch
    from runtime.warm import serve

    spec = WorkerSpec.from_dict(spec_dict)
    store = open_store_ref(spec.store_url)
    try:
        reason = serve(spec, store, lambda job: WorkerResult.from_dict(train_epoch(job.to_dict())),
                       lambda: open_store_ref(spec.store_url), open_ref=open_store_ref)
    finally:
        store.close()
    return {"run_id": spec.run_id, "rank": spec.rank, "warm": True, "stopped": reason}


@flow(name="worker", persist_result=True, result_serializer="json", log_prints=True)
def worker(spec: dict) -> dict:
    """Train one replica (or stage): one epoch, or every epoch the coordinator sends (warm); or
    write one cut of a prepare (`flows.prepare_cuts`). The provider's notice (SIGTERM) is the
    worker's from the flow's start (`engine.preemption.leaving`, in place of Prefect's handler):
    an epoch hands over, anywhere else (start-up, a profile, a warm worker's wait) it leaves at once."""
    with preemption.leaving():
        if CUT_SPEC in spec:
            # torch: loaded by a cut's run, as by an epoch's
            from engine.array_cuts import run_cut_job

            return run_cut_job(spec[CUT_SPEC], open_store_ref)
        if spec.get("warm"):
            return serve_warm(spec)
        return run_worker(spec)


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.worker --spec-json '<json>'`: `runtime.worker_main` for a worker
    process whose store is a saved block (`block:<type slug>/<name>`): the process loads the
    block from the Prefect API itself, so its secret never travels in the spec, an argument
    or the environment. The inline launcher starts this entry only for block stores (the
    plain one does not import Prefect)."""
    # torch: Prefect loads this module to read the flow's parameters; the epoch loads torch
    from runtime.worker_main import main as worker_main

    return worker_main(argv, open_ref=open_store_ref)


if __name__ == "__main__":
    import sys

    sys.exit(main())

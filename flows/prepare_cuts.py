"""The `prepare` flow's parallel cut of a files-of-arrays source (`arrays:`, `engine.array_source`):
the plan fixed from the files' headers, one task run per cut, each cut written by a process of its
own on the compute target, the manifest written last from the cuts' `ShardInfo` rows.

Where a cut runs follows the `target` parameter, as a training run's workers do:

- `inline` (the command line's default): a child process of the flow
  (`python -m runtime.array_cut_main --cut-json ...`, without Prefect; `python -m
  flows.prepare_cuts` where a store is a block), as the `inline` target's workers are.
- a target with a work pool (`local`: the `zooid-local` process pool, which the `prepare/local`
  deployment uses; or a saved Zooid Compute Target block): a flow run of the target's worker
  deployment (`worker/local`), started with `run_deployment` and polled until final, as the train
  flow's `PoolLauncher` starts its workers; the `worker` flow writes it (`flows.worker`: a spec with
  a `prepare_cut`) and returns its result as JSON.

The cuts' task runs are named after their shards (`cut train shards 0-7`) and run `workers` at
once, each a thread waiting on its process. Every cut finishes before a failed one fails the
flow, so a prepare run again keeps each whole shard the others wrote (`engine.shards.write_shard`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from prefect import task
from prefect.cache_policies import NO_CACHE

from blocks.compute import resolve_target
from blocks.store_block import BLOCK_PREFIX
from blocks.store_refs import open_store_ref
from coordinator.run.validate import check_target_ready
from core.errors import ZooidError, ZooidValueError
from engine.array_cuts import Cut, arrays_manifest, plan_cuts
from engine.array_source import ArrayLayout, arrays_ref, scan_arrays
from engine.datasets import Prepared
from engine.shards import read_dataset_manifest, write_manifest
from flows.worker import CUT_SPEC
from runtime.array_cut_main import main as array_cut_main

ROOT = Path(__file__).resolve().parent.parent
ARRAY_CUT_MAIN = "runtime.array_cut_main"
"""An inline cut's entry point (no Prefect)."""
POLL_S = 0.5
"""How often a cut's flow run on a pool is read until it ends."""


class CutFailed(ZooidError):
    """A cut whose process or flow run did not complete (one line: the cut and why)."""


def cut_job(cut: Cut, source: str, to: str, prefix: str = "") -> dict[str, Any]:
    """What a cut's process is given (JSON-able): the cut, the source's and the destination's
    store references and the destination prefix."""
    return {"cut": cut.to_dict(), "source": source, "to": to, "prefix": prefix}


def _inline(job: dict[str, Any], label: str) -> dict[str, Any]:
    """Run a cut as a child process of this one (`runtime.array_cut_main`, without Prefect; this
    module's own `main` where a store is a block, loaded from the API the flow uses); its
    result is its last line of output."""
    from prefect.settings import PREFECT_API_URL

    env, entry = dict(os.environ), ARRAY_CUT_MAIN
    if any(job[ref].startswith(BLOCK_PREFIX) for ref in ("source", "to")):
        entry = "flows.prepare_cuts"
        env["PREFECT_API_URL"] = PREFECT_API_URL.value() or ""
    done = subprocess.run([sys.executable, "-m", entry, "--cut-json", "-"], input=json.dumps(job), cwd=ROOT,
                          check=False, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        raise CutFailed(f"{label} failed: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _on_pool(job: dict[str, Any], label: str, deployment: str, job_variables: dict) -> dict[str, Any]:
    """Run a cut as a flow run of the target's worker deployment and wait for its JSON result."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    # the local stack's module: loaded only where cuts run on a pool
    from deployments.stack import wait_final

    flow_run = run_deployment(deployment, parameters={"spec": {CUT_SPEC: job}}, timeout=0,
                              job_variables=job_variables or None, tags=["zooid-prepare"],
                              flow_run_name=f"prepare-{label.replace(' ', '-')}")
    with get_client(sync_client=True) as client:
        state = wait_final(client, flow_run.id, timeout_s=float("inf"), poll_s=POLL_S).state
    if not state.is_completed():
        said = (state.message or "").strip().splitlines()
        raise CutFailed(f"{label} failed: flow run {flow_run.name} {state.type.value.lower()}"
                        + (f": {said[-1]}" if said else ""))
    return state.result()


@task(name="prepare_cut", cache_policy=NO_CACHE, persist_result=False, task_run_name="{label}")
def cut_task(label: str, job: dict[str, Any], pool: dict[str, Any] | None) -> dict[str, Any]:
    """Write one cut in a process of its own: inline, or on `pool` (its worker deployment and
    job variables). Not retried here: a prepare run again goes on where this one stopped."""
    if pool is None:
        return _inline(job, label)
    return _on_pool(job, label, pool["deployment"], pool.get("job_variables") or {})


def cut_pool(target: str) -> dict[str, Any] | None:
    """Where the cuts run for compute target `target`: None (child processes) for `inline`, else
    its worker deployment and job variables; ZooidValueError naming `target` when it is none."""
    try:
        compute = resolve_target(target)
    except ValueError as exc:
        raise ZooidValueError("target", str(exc).removeprefix("target: ")) from None
    if not compute.remote:
        return None
    # training's readiness check (its deployment and pool exist, the provider's preflight), which
    # reads a resolved job's target and its name alone
    check_target_ready(SimpleNamespace(target=compute, target_name=target))
    return {"deployment": compute.worker_deployment, "job_variables": compute.job_variables}


class ArraySource(NamedTuple):
    """A files-of-arrays source checked before anything is written (`check_arrays`)."""

    dataset: str
    ref: str
    """Its store reference (`engine.array_source.arrays_ref`)."""
    layout: ArrayLayout
    pool: dict[str, Any] | None
    """Where its cuts run (`cut_pool`)."""


def check_arrays(dataset: str, target: str) -> ArraySource:
    """Read the headers of the files-of-arrays source `dataset` (`engine.array_source.scan_arrays`)
    and resolve `target`: a malformed source or an unknown target is refused in one line naming
    `dataset` or `target` before anything is written."""
    ref = arrays_ref(dataset)
    try:
        source = open_store_ref(ref)
    except ZooidValueError as exc:
        raise ZooidValueError("dataset", f"{dataset!r}: {exc}") from None
    try:
        layout = scan_arrays(source)
    finally:
        source.close()
    return ArraySource(dataset, ref, layout, cut_pool(target))


def prepare_arrays(store, source: ArraySource, to: str, subset_size: int, workers: int,
                   prepared_by: str = "") -> tuple[Prepared, list[dict[str, Any]]]:
    """Prepare a checked files-of-arrays `source` into the root of `store` (reference `to`), in
    cuts (module docstring); an equal preparation there (the same source name, shard rows and
    files, by their keys and sizes) is left as it is. Returns what was done and, per cut, its
    name, the shards it wrote and the process that wrote them."""
    settings = {"source": source.dataset, "subset_size": subset_size, "text": None,
                "files": source.layout.fingerprint}
    try:
        there = read_dataset_manifest(store, "")
    except ZooidValueError:
        there = None  # none, or another format: prepared (again) below
    if there is not None and there.settings == settings:
        return Prepared(there, 0, 0, True), []
    cuts = plan_cuts(source.layout, subset_size, workers)
    to = to if to.startswith(BLOCK_PREFIX) else store.url  # a relative path as the cuts' processes find it
    done = run_cuts(cuts, source.ref, to, source.pool, workers)
    manifest = arrays_manifest(source.dataset, source.layout, cuts, done, settings, prepared_by)
    write_manifest(store, "", manifest)  # last: its presence means every shard is readable
    written = sum(r["written"] for r in done)
    report = [{"cut": c.label, "written": r["written"], "pid": r["pid"]} for c, r in zip(cuts, done)]
    return Prepared(manifest, written, sum(c.shards for c in cuts) - written, False), report


def run_cuts(cuts: list[Cut], source: str, to: str, pool: dict[str, Any] | None, workers: int) -> list[dict]:
    """Run every cut, `workers` at once, each a task run; their results in the order of `cuts`.
    Raises the first failure once every cut has ended."""
    from prefect.task_runners import ThreadPoolTaskRunner

    results, failures = [], []
    with ThreadPoolTaskRunner(max_workers=workers) as runner:
        futures = [runner.submit(cut_task, {"label": c.label, "job": cut_job(c, source, to), "pool": pool})
                   for c in cuts]
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:  # every cut ends before one failure fails the prepare
                failures.append(exc)
    if failures:
        raise CutFailed(f"{len(failures)} of {len(cuts)} cuts failed (run the prepare again to go on: whole shards "
                        f"are kept): {str(failures[0]).splitlines()[0]}")
    return results


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.prepare_cuts --cut-json '<job>'`: `runtime.array_cut_main` for a cut whose
    source or destination is a store block, loaded from the Prefect API in this process (its
    secret never travels in the job, an argument or the environment)."""
    return array_cut_main(argv, open_ref=open_store_ref)


if __name__ == "__main__":
    sys.exit(main())

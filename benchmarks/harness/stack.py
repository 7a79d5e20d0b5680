"""A local stack for the block (`deployments.stack.up`: a Prefect server, the `zooid-local`
process pool and its worker, `train/local`), and `train/local` runs on it, read back.

Prefect is imported inside these functions: it reads its settings from the environment when
first imported, which `local_stack` sets, and the scripts that use none of this stay light.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.replicas import Trace
from core.keys import ledger_key, run_prefix, summary_key

POOL = "zooid-local"
"""The local stack's process work pool (`deployments.stack.POOL`)."""
RUN_TIMEOUT_S = 3600.0
"""How long one traced run (`pool_trace`) may take before it is cancelled and recorded as such."""


@contextmanager
def local_stack(home: Path, *, docker: bool = False) -> Iterator[dict]:
    """The local stack under `home` (with its container half when `docker`) on a free port,
    never the stack's preferred 4200, so a developer's `make up` keeps it; its environment and
    API set in this process for the block (`scratch` restores the environment). Stopped (by pid)
    however the block ends. Yields the stack's state (`api_url`, `env`, ...)."""
    from deployments.server import free_port
    from deployments.stack import down, up

    try:
        state = up(home=home, port=free_port(0), docker=docker)
        os.environ.update(state["env"])
        from prefect.settings import PREFECT_API_URL, temporary_settings  # after the stack's environment is set

        with temporary_settings(updates={PREFECT_API_URL: state["api_url"]}):
            yield state
    finally:
        down(home)


def pool_summary(params: dict, timeout_s: float = 900, target: str = "local") -> dict:
    """Run `params` (TrainJob fields) as `train/local` on the stack of the enclosing
    `local_stack`, on `target` (`local`: the process pool; `docker`: the stack's container half,
    with a store the containers reach in `params`); the run's summary from its store, with the
    flow run's state, `submitted_at` (just before `run_deployment`), `seen_final_at` (the first
    poll, every 0.1 s, that found it final) and Prefect's `flow_start_at` / `flow_end_at`.
    RuntimeError when it did not complete."""
    from deployments.stack import run_and_wait  # imports Prefect: see the module docstring

    summary = run_and_wait({**params, "target": target}, timeout_s, poll_s=0.1)
    if summary.get("flow_run_state") != "COMPLETED" or summary.get("status") == "failed":
        raise RuntimeError(f"pool run ended {summary.get('flow_run_state')} / {summary.get('status')}: "
                           f"{summary.get('error')}")
    return summary


@dataclass
class PoolRun(Trace):
    """One configuration's `train/local` flow run: the per-epoch figures of its summary.json
    (`accuracy`, `seconds`, `bytes_synced`, and each epoch's ledger rows, `cost_usd`), its
    ledger's total (cost.json) and how it ended."""

    run_id: str = ""
    status: str = ""
    perplexity: list[float] = field(default_factory=list)
    """Each epoch's validation perplexity (summary `val_perplexity`; NaN for a classifier)."""
    cost_usd: list[float] = field(default_factory=list)
    startup_s: list[float] = field(default_factory=list)
    """Each epoch's worker start-up inside its `seconds` (summary `startup.exposed_s`: the first
    epoch waits for the warm workers to start; later ones find them up)."""
    workers: list[int] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    """Each epoch's slowest worker's compute and sync seconds (summary `compute_s`, `sync_s`)."""
    bill_usd: float | None = None
    run_s: float = 0.0
    """Submitted to final, as the benchmark saw it (profile, plan, start-up and teardown included)."""
    offers: dict[str, float] = field(default_factory=dict)
    """Offer -> price per second of the ledger's worker rows."""

    @property
    def ok(self) -> bool:
        return self.status == "COMPLETED / completed" and bool(self.accuracy)

    def cost_to(self, target: float) -> float:
        return sum(self.cost_usd[:self.reached(target) or len(self.cost_usd)])

    def startup_to(self, target: float) -> float:
        return sum(self.startup_s[:self.reached(target) or len(self.startup_s)])


def pool_trace(home: Path, params: dict, name: str, seed: int) -> PoolRun:
    """Run `params` (TrainJob fields) as a `train/local` flow run on the stack under `home` (its
    API configured in this process: `local_stack`), cancelled after `RUN_TIMEOUT_S`, and read back
    its summary and ledger from the stack's directory store; the run's folder there is removed
    afterwards when it ended well (a synthetic dataset is 100 MB a run)."""
    from prefect.client.orchestration import get_client  # imports Prefect: see the module docstring
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from coordinator.run.context import run_id_for
    from coordinator.workers.sweep import tagged_pids
    from deployments.stack import wait_final

    t0 = time.monotonic()
    flow_run = run_deployment("train/local", parameters=params, timeout=0)
    trace = PoolRun(name, seed, run_id=run_id_for(flow_run.id))
    with get_client(sync_client=True) as client:
        try:
            fr = wait_final(client, flow_run.id, RUN_TIMEOUT_S)
        except TimeoutError:
            print(f"run {trace.run_id} still running after {RUN_TIMEOUT_S:.0f} s: cancelling it", flush=True)
            client.set_flow_run_state(flow_run.id, Cancelling(message="benchmark time limit"), force=True)
            fr = wait_final(client, flow_run.id, 300)
    trace.run_s = time.monotonic() - t0
    store = home / "store"
    summary_file, ledger_file = store / summary_key(trace.run_id), store / ledger_key(trace.run_id)
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    ledger = json.loads(ledger_file.read_text()) if ledger_file.exists() else {}
    trace.status = f"{fr.state.type.value} / {summary.get('status', 'no summary')}"
    if summary.get("error"):
        trace.status += f": {summary['error'][:200]}"
    for e in sorted(summary.get("epochs", []), key=lambda e: e["epoch"]):
        acc = e.get("val_accuracy")
        trace.accuracy.append(math.nan if acc is None else float(acc))
        trace.perplexity.append(math.nan if e.get("val_perplexity") is None else float(e["val_perplexity"]))
        trace.seconds.append(float(e["seconds"]))
        trace.bytes_synced.append(int(e.get("bytes_synced", 0)))
        trace.cost_usd.append(float(e.get("cost_usd", 0.0)))
        startup = e.get("startup") or {}
        trace.startup_s.append(float(startup.get("exposed_s", startup.get("critical_exposed_s", 0.0))))
        trace.workers.append(int(e["workers"]))
        trace.compute_s.append(float(e.get("compute_s", 0.0)))
        trace.sync_s.append(float(e.get("sync_s", 0.0)))
    trace.bill_usd = ledger.get("total_usd")
    trace.offers = {r["offer"]: r["unit_price_per_s"] for r in ledger.get("rows", []) if r.get("kind") == "worker"}
    deadline = time.monotonic() + 60  # the next run starts on an idle pool
    while tagged_pids(trace.run_id) and time.monotonic() < deadline:
        time.sleep(1)
    if tagged_pids(trace.run_id):
        trace.status += f"; worker processes {tagged_pids(trace.run_id)} still alive 60 s after its end"
    if trace.ok:
        shutil.rmtree(store / run_prefix(trace.run_id), ignore_errors=True)
    return trace

"""The local stack for real: Prefect server, `zooid-local` process pool, one Prefect worker,
and `train/local` fanning out `worker/local` flow runs through `run_deployment`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_train_local_deployment_through_process_pool(tmp_path):
    home = tmp_path / "zooid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    proc = subprocess.run([sys.executable, "-m", "deployments.stack", "run", "--param", "workers=3",
                           "--param", "epochs=2", "--param", "batch_size=32"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = proc.stdout
    assert "completed" in report and "total cost $" in report

    # the run honoured both parameters, and its summary and ledger are in the store
    runs = list((home / "store" / "runs").iterdir())
    assert len(runs) == 1
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert [e["workers"] for e in summary["epochs"]] == [3, 3]
    ledger = json.loads((runs[0] / "cost.json").read_text())
    busy = [r for r in ledger["rows"] if r["kind"] == "worker" and r["status"] == "busy"]
    assert len(busy) == 6 and ledger["total_usd"] > 0
    # warm workers: one worker flow run per rank lived through both epochs, in one process
    pids = [e["worker_pids"] for e in summary["epochs"]]
    assert pids[0] == pids[1] and len(set(pids[0].values())) == 3
    assert len({r["worker"] for r in busy}) == 3

    # worker flow results were persisted as JSON (never pickle) where the coordinator read them
    results = [p for p in (home / "results").iterdir() if p.is_file()]
    warm_results = []
    for path in results:
        doc = json.loads(path.read_text())  # every persisted result is JSON, none is pickle
        if isinstance(doc, dict) and doc.get("warm"):
            warm_results.append(doc)
    assert sorted(r["rank"] for r in warm_results) == [0, 1, 2]
    assert all(r["stopped"] == "stopped" for r in warm_results)

    # `run` stopped everything it started
    assert not (home / "stack.json").exists()
    from tasks.sweep import tagged_pids

    assert tagged_pids(runs[0].name) == []


@pytest.mark.slow
def test_cancelling_a_training_run_stops_its_workers_and_bills_it(tmp_path):
    """`prefect flow-run cancel` on a train/local run: the run ends Cancelled, its worker flow
    runs are cancelled, no worker process is left, and the ledger has the run's cost."""
    import time

    from deployments import stack
    from tasks.context import run_id_for
    from tasks.sweep import tagged_pids

    home = tmp_path / "zooid"
    saved = dict(os.environ)
    state = stack.up(home=home)
    try:
        os.environ.update(state["env"])
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings
        from prefect.states import Cancelling

        with temporary_settings(updates={PREFECT_API_URL: state["api_url"]}):
            with get_client(sync_client=True) as client:  # the nightly schedule ships paused
                nightly = client.read_deployment_by_name("train/nightly")
                assert [s.active for s in nightly.schedules] == [False]
                assert nightly.schedules[0].schedule.cron == "0 2 * * *"
            # warm workers: one worker flow run per rank, one train_epoch task run per epoch in it
            from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

            done = stack.run_and_wait({"workers": 2, "epochs": 2, "target": "local"}, 400)
            with get_client(sync_client=True) as client:
                workers = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=[f"zooid-run:{done['run_id']}"])))
                assert len(workers) == 2 and all(w.state.is_completed() for w in workers)
                for w in workers:
                    epochs = client.read_task_runs(task_run_filter=TaskRunFilter(
                        flow_run_id=TaskRunFilterFlowRunId(any_=[w.id])))
                    assert sorted(t.name.split(" rank")[0] for t in epochs) == ["epoch 0", "epoch 1"]
                    assert all(t.state.is_completed() for t in epochs)
            flow_run = run_deployment("train/local", parameters={"epochs": 8, "workers": 2}, timeout=0)
            run_id = run_id_for(flow_run.id)
            deadline = time.time() + 240
            while not tagged_pids(run_id) and time.time() < deadline:
                time.sleep(0.5)
            assert tagged_pids(run_id), "no worker started"
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run.id, Cancelling(message="user cancel"), force=True)
                deadline = time.time() + 120
                while time.time() < deadline:
                    if client.read_flow_run(flow_run.id).state.is_final() and not tagged_pids(run_id):
                        break
                    time.sleep(1)
                assert client.read_flow_run(flow_run.id).state.is_cancelled()
                workers = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=[f"zooid-run:{run_id}"])))
                assert workers and all(w.state.is_final() for w in workers)
            # a worker flow run the pool was starting as the cancel landed may still be
            # importing; its engine finds the run Cancelled and exits: allow it those seconds,
            # while a leaked worker (8 epochs to train) would outlive them
            deadline = time.time() + 30
            while tagged_pids(run_id) and time.time() < deadline:
                time.sleep(1)
            assert tagged_pids(run_id) == []
            ledger = json.loads((home / "store" / "runs" / run_id / "cost.json").read_text())
            assert ledger["total_usd"] > 0
    finally:
        stack.down(home)
        os.environ.clear()
        os.environ.update(saved)

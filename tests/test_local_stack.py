"""The local stack for real: Prefect server, `zooid-local` process pool, one Prefect worker,
and `train/local` fanning out `worker/local` flow runs through `run_deployment`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.server import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_train_local_deployment_through_process_pool(tmp_path):
    home = tmp_path / "zooid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    port = str(free_port(0))  # not the preferred 4200: other test processes start stacks too
    proc = subprocess.run([sys.executable, "-m", "deployments.stack", "run", "--port", port, "--param", "workers=2",
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
    assert [e["workers"] for e in summary["epochs"]] == [2, 2]
    ledger = json.loads((runs[0] / "cost.json").read_text())
    busy = [r for r in ledger["rows"] if r["kind"] == "worker" and r["status"] == "busy"]
    assert len(busy) == 4 and ledger["total_usd"] > 0
    # warm workers: one worker flow run per rank lived through both epochs, in one process
    pids = [e["worker_pids"] for e in summary["epochs"]]
    assert pids[0] == pids[1] and len(set(pids[0].values())) == 2
    assert len({r["worker"] for r in busy}) == 2

    # worker flow results were persisted as JSON (never pickle) where the coordinator read them
    results = [p for p in (home / "results").iterdir() if p.is_file()]
    warm_results = []
    for path in results:
        doc = json.loads(path.read_text())  # every persisted result is JSON, none is pickle
        if isinstance(doc, dict) and doc.get("warm"):
            warm_results.append(doc)
    assert sorted(r["rank"] for r in warm_results) == [0, 1]
    assert all(r["stopped"] == "stopped" for r in warm_results)

    # `run` stopped everything it started
    assert not (home / "stack.json").exists()
    from coordinator.workers.sweep import tagged_pids

    assert tagged_pids(runs[0].name) == []


def test_local_deployments_start_without_a_pull_step_from_the_module_the_fork_server_imported():
    """The local pool's deployments (prefect.yaml) name their flows by module path and run in
    the checkout as the pool's working directory, with no pull step: Prefect then imports the
    flow the stack's fork server has imported already, where a pull step and a file path's
    fresh import cost each flow run's start 0.15-0.2 s (twice a run: its own, its workers')."""
    import yaml
    from prefect import Flow
    from prefect.utilities.importtools import import_object

    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert config["pull"] == []  # explicit: `prefect deploy` would otherwise make one
    local = [d for d in config["deployments"] if d["work_pool"]["name"] == "zooid-local"]
    assert {d["entrypoint"].rsplit(".", 1)[-1] for d in local} == {"train_with_params", "plan_with_params", "prepare",
                                                                   "worker"}
    for deployment in local:
        assert "pull" not in deployment and ":" not in deployment["entrypoint"]
        assert deployment["work_pool"]["job_variables"] == {"working_dir": "{{ $ZOOID_ROOT }}"}
        assert isinstance(import_object(deployment["entrypoint"]), Flow)
    # every other deployment brings its own pull step (the image's working directory)
    assert all(d.get("pull") for d in config["deployments"] if d not in local)

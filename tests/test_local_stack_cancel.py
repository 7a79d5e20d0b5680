"""The local stack for real, cancelled: the session's stack (`stack.up`, shared with the docker
tests: `tests/docker_stack.py`), the paused nightly schedule, warm workers as worker flow runs (one
per rank, a task run per epoch), then `prefect flow-run cancel` on a train/local run."""
from __future__ import annotations

import json
import time

import pytest

from tests.docker_stack import stack_for_the_module

stack = pytest.fixture(scope="module", name="stack")(stack_for_the_module)


@pytest.mark.slow
def test_cancelling_a_training_run_stops_its_workers_and_bills_it(stack):
    """`prefect flow-run cancel` on a train/local run: the run ends Cancelled, its worker flow
    runs are cancelled, no worker process is left, and the ledger has the run's cost."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, TaskRunFilter, TaskRunFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from coordinator.run.context import run_id_for
    from coordinator.workers.sweep import tagged_pids
    from deployments import stack as local_stack

    home = stack["home"]
    with get_client(sync_client=True) as client:
        # `up` returned once the pool's worker polls: a run submitted at once is picked up at once
        assert [w.status.value for w in client.read_workers_for_work_pool(local_stack.POOL)] == ["ONLINE"]
        # the local deployments start without a pull step, from the module the fork server imported
        worker = client.read_deployment_by_name("worker/local")
        assert worker.pull_steps == [] and worker.entrypoint == "flows.worker.worker"
        assert worker.job_variables == {"working_dir": str(local_stack.ROOT)}
    with get_client(sync_client=True) as client:  # the nightly schedule ships paused
        nightly = client.read_deployment_by_name("train/nightly")
        assert [s.active for s in nightly.schedules] == [False]
        assert nightly.schedules[0].schedule.cron == "0 2 * * *"
    # warm workers: one worker flow run per rank, one train_epoch task run per epoch in it
    done = local_stack.run_and_wait({"workers": 2, "epochs": 2, "target": "local"}, 400)
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

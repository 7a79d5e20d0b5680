"""The docker target's cleanup (`tests/docker_stack.py`'s stack): a cancelled flow run leaves no
container, teardown sweeps a labelled straggler and bills it from the engine's clock."""
from __future__ import annotations

import time
import uuid

import pytest

from tests.docker_stack import _client, _containers, _held_run, _summary, _wait_final, stack_for_the_module

pytestmark = [pytest.mark.slow, pytest.mark.docker]
stack = pytest.fixture(scope="module", name="stack")(stack_for_the_module)


def test_cancelling_the_flow_run_leaves_no_container(stack):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    flow_run_id, run_id, store = _held_run(stack, epoch=1, rank=0, epochs=3)
    try:
        assert len(_containers(run_id, running_only=True)) == 2
        with get_client(sync_client=True) as client:  # what the UI's Cancel does
            client.set_flow_run_state(flow_run_id, Cancelling(message="cancelled by the test"), force=True)
        fr = _wait_final(flow_run_id)
        deadline = time.monotonic() + 120
        while _containers(run_id) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        store.put(f"runs/{run_id}/release", b"1")
        store.close()
    # the runner sees Cancelling, stops the flow's process and marks the run Cancelled; the
    # flow wrote its summary and final bill as it stopped
    assert fr.state.is_cancelled(), fr.state
    assert _summary(stack, run_id)["status"] == "cancelled"
    assert _containers(run_id) == []


def test_teardown_sweeps_a_container_left_behind_by_label(stack):
    from types import SimpleNamespace

    from blocks.compute import resolve_target
    from coordinator.run.context import RunContext
    from coordinator.run.job import TrainJob
    from coordinator.workers.cleanup import teardown_run
    from planners.catalog import get_offer

    run_id = f"left-{uuid.uuid4().hex[:8]}"
    client = _client()
    try:
        left = client.containers.run(stack["docker"]["image"], ["sleep", "600"], detach=True,
                                     labels={"zooid-run": run_id}, network_mode="host")
    finally:
        client.close()
    assert [c.id for c in _containers(run_id, running_only=True)] == [left.id]
    ctx = RunContext(run_id=run_id, job=TrainJob(target="docker"),
                     resolved=SimpleNamespace(target=resolve_target("docker"), offer=get_offer("fargate-cpu"),
                                              store_ref="", durable_ref=""))
    report = teardown_run(ctx)
    assert report.get("swept") == [left.id[:12]]
    assert _containers(run_id) == []
    # the straggler was billed from the engine's clock before it was removed
    stragglers = [r for r in ctx.state.ledger if r.resource.endswith(left.id[:12])]
    assert len(stragglers) == 1 and stragglers[0].stop > stragglers[0].start

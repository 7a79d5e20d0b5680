"""A spot preemption on the docker target (`tests/docker_stack.py`'s stack): the engine's own
`stop -t GRACE` (`clouds.docker.preempt`: SIGTERM to the container's PID 1, the flow run's
engine, then SIGKILL after the grace) stops a worker container while its epoch holds it. The
worker hands over and leaves within the grace, the coordinator replaces it on spot at once, the
run completes, the preempted interval is billed once and marked, and no container is left."""
from __future__ import annotations

import pytest

from tests.docker_stack import (_client, _containers, _ledger, _run_id, _save_target, _store, _submit, _summary,
                                _wait_final, _wait_key, stack_for_the_module)

pytestmark = [pytest.mark.slow, pytest.mark.docker]
stack = pytest.fixture(scope="module", name="stack")(stack_for_the_module)


def test_a_spot_container_stopped_with_a_grace_hands_over_and_is_replaced(stack):
    from clouds.docker import preempt
    from engine.preemption import read_preempted_marker

    # rank 1 holds at the start of epoch 1 (an event: its held marker) until the notice comes
    target = _save_target("docker-preempt-e1r1", job_variables={"env": {
        "ZOOID_CHAOS": "hold_worker:epoch=1:rank=1:until=release"}})
    flow_run_id = _submit(stack, strategy="local_sgd", workers=2, epochs=2, target=target, capacity="spot")
    run_id = _run_id(flow_run_id)
    store = _store(stack)
    try:
        _wait_key(store, f"runs/{run_id}/faults/held-e1-r1-")
        victim = next(c for c in _containers(run_id, running_only=True)
                      if "-warm-r1-" in c.labels.get("io.prefect.flow-run-name", ""))
        client = _client()
        try:
            stopped = preempt(client, victim.id, grace_s=60)  # returns once the container has exited
        finally:
            client.close()
        fr = _wait_final(flow_run_id)
        notice = read_preempted_marker(store, run_id, 1, 1, 0)
        store.put(f"runs/{run_id}/release", b"1")  # nothing should be held by then; never hang
    finally:
        store.close()
    assert not stopped["killed"] and stopped["exit_code"] != 137, stopped  # it left within the grace
    assert notice is not None and notice["handover"] and notice["step"] == 0, notice
    assert fr.state.is_completed(), fr.state.message
    summary = _summary(stack, run_id)
    assert summary["status"] == "completed" and len(summary["epochs"]) == 2
    assert [r["failure"]["kind"] for r in summary["epochs"][1]["relaunches"]] == ["preempted"]
    assert summary["spot"]["preemptions"] == 1 and summary["spot"]["saved_usd"] > 0
    rows = _ledger(stack, run_id)
    preempted = [r for r in rows if r["status"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["resource"].endswith(victim.id[:12]) and preempted[0]["usd"] > 0
    workers = [r for r in rows if r["kind"] in ("worker", "failed_attempt")]
    assert {r["capacity"] for r in workers} == {"spot"}  # one preemption: replaced on spot again
    assert len({r["resource"] for r in workers}) == len(workers)  # each container billed once
    assert _containers(run_id) == []

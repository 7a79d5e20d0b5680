"""A spot preemption on the docker target (`tests/docker_stack.py`'s stack): the engine's own
`stop -t GRACE` (`clouds.docker.preempt`: SIGTERM to the container's PID 1, the flow run's
engine, then SIGKILL after the grace) stops a worker container while its epoch holds it, or while
it waits idle between epochs. The worker works through the notice until its successor (a warm
spare, or one its pool starts at the notice) is ready, then hands over and leaves within the
grace; the run completes, the preempted interval is billed once and marked, and no container is
left."""
from __future__ import annotations

import pytest

from tests.docker_stack import (_client, _containers, _ledger, _run_id, _save_target, _store, _submit, _summary,
                                _wait_final, _wait_key, stack_for_the_module)

pytestmark = [pytest.mark.slow, pytest.mark.docker]
stack = pytest.fixture(scope="module", name="stack")(stack_for_the_module)


def _preempt_rank(run_id: str, rank: int, grace_s: int):
    """Stop rank `rank`'s running warm container as the provider would (`clouds.docker.preempt`:
    SIGTERM, SIGKILL after `grace_s`); returns (the container, what the stop saw) once it exited."""
    from clouds.docker import preempt

    victim = next(c for c in _containers(run_id, running_only=True)
                  if f"-warm-r{rank}-" in c.labels.get("io.prefect.flow-run-name", ""))
    client = _client()
    try:
        return victim, preempt(client, victim.id, grace_s=grace_s)
    finally:
        client.close()


def _worker_flow_runs(run_id: str) -> list[str]:
    """The names of the run's warm worker flow runs (`<run>-warm-<worker>`), as Prefect has them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=f"{run_id}-warm-")))
    return sorted(r.name.split("-warm-", 1)[1].rsplit("-", 1)[0] for r in runs)


def test_a_spot_container_stopped_with_a_grace_hands_over_and_is_replaced_by_its_warm_spare(stack):
    """Also what `capacity=spot` asks of the docker target: the plan is on spot, every worker
    container is labelled `zooid.capacity=spot` (read from the engine while the run holds its
    workers) and billed at Fargate Spot's price for its size; the coordinator stays on-demand."""
    from blocks.compute import resolve_target
    from clouds.docker import CAPACITY_LABEL
    from engine.preemption import read_preempted_marker
    from planners.catalog import get_offer, spot_offer

    # rank 1 holds at the start of epoch 1 (an event: its held marker) until the notice comes
    target = _save_target("docker-preempt-e1r1", job_variables={"env": {
        "ZOOID_CHAOS": "hold_worker:epoch=1:rank=1:until=release"}})
    flow_run_id = _submit(stack, strategy="local_sgd", workers=2, epochs=2, target=target, capacity="spot",
                          spot_spares=1)
    run_id = _run_id(flow_run_id)
    store = _store(stack)
    try:
        _wait_key(store, f"runs/{run_id}/faults/held-e1-r1-")
        labels = {c.id: c.labels.get(CAPACITY_LABEL) for c in _containers(run_id)}  # the ranks' and the spare's
        victim, stopped = _preempt_rank(run_id, 1, grace_s=120)  # Fargate Spot's notice
        fr = _wait_final(flow_run_id)
        notice = read_preempted_marker(store, run_id, 1, 1, 0)
        store.put(f"runs/{run_id}/release", b"1")  # nothing should be held by then; never hang
    finally:
        store.close()
    assert not stopped["killed"] and stopped["exit_code"] == 6, stopped  # within the grace, with the notice's status
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
    assert len(labels) >= 2 and set(labels.values()) == {"spot"}, labels
    assert summary["plan"]["capacity"] == "spot" and summary["plan"]["capacity_choice"]["spot_offer"] == "fargate-spot-cpu"
    t = resolve_target(target)
    spot = spot_offer("fargate-cpu", "docker").price_per_s(t.worker_vcpu, t.worker_memory_gb, t.worker_gpu)
    assert all(r["unit_price_per_s"] == pytest.approx(spot, rel=1e-9) for r in workers)
    coordinator = [r for r in rows if r["kind"] == "coordinator"]
    assert coordinator and coordinator[0]["unit_price_per_s"] == pytest.approx(  # its own size (digits: 1 GB)
        get_offer("fargate-cpu").price_per_s(t.coordinator_vcpu, 1.0, 0), rel=1e-9)
    assert len({r["resource"] for r in workers}) == len(workers)  # each container billed once
    # rank 1's place went to the spare started with the ranks; no new rank worker, a new spare instead
    assert _worker_flow_runs(run_id) == ["r0-w0", "r1-w1", "spare-w2", "spare-w3"]
    assert len(workers) == 4  # and each of the four containers is billed
    assert _containers(run_id) == []


def _idle_status(store, run_id: str, rank: int, epoch: int, timeout_s: float = 600) -> str:
    """The status key of rank `rank`'s warm worker once it answered epoch `epoch` and waits for
    its next command (an event the worker writes, `runtime.warm`)."""
    import json
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for key in store.list(f"runs/{run_id}/warm/r{rank}-"):
            if key.endswith("/status.json"):
                status = json.loads(store.get(key))
                if status.get("state") == "idle" and status.get("epoch") == epoch:
                    return key
        time.sleep(0.2)
    raise TimeoutError(f"rank {rank} not idle after epoch {epoch} within {timeout_s:.0f} s")


def _status_with(store, run_id: str, prefix: str, timeout_s: float = 600, **want) -> dict:
    """The status of the run's warm worker named `prefix...` once it has every field of `want`
    (a value of `...` only needs the field), an event the worker writes (`runtime.warm`)."""
    import json
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for key in store.list(f"runs/{run_id}/warm/{prefix}"):
            if key.endswith("/status.json"):
                status = json.loads(store.get(key))
                if all(k in status and (v is ... or status[k] == v) for k, v in want.items()):
                    return {**status, "key": key}
        time.sleep(0.2)
    raise TimeoutError(f"no status of {prefix} with {want} within {timeout_s:.0f} s")


def test_an_idle_warm_container_given_the_notice_works_through_it_and_hands_its_rank_to_a_successor(stack):
    """Rank 0 holds after epoch 0's last sync, so rank 1 has answered epoch 0 and waits, warm and
    idle, when the engine's stop with Fargate Spot's 120 s grace reaches it. It does not leave:
    its status says it got the notice, its pool starts a successor at epoch 1 (the run's 8 epochs
    outlast the notice's 90 s of work, at the pace of its first) and rank 1 trains epoch 1 meanwhile (rank 0 holds again at its start until the successor says it is ready);
    then the successor takes rank 1 (between epochs, or at a step boundary of epoch 1 after the
    release), the victim leaves with the worker's own status 6 long before the SIGKILL, the run
    completes, and every container is billed once, the victim's as preempted."""
    import threading

    # the target expects start-ups of 90 s: the successor is due at the notice (`_successor_due`)
    target = _save_target("docker-preempt-idle", startup_s=90.0, job_variables={"env": {
        "ZOOID_CHAOS": "hold_worker:epoch=0:rank=0:at=sync:until=release,hold_worker:epoch=1:rank=0:until=ready"}})
    flow_run_id = _submit(stack, strategy="local_sgd", workers=2, epochs=8, target=target, capacity="spot")
    run_id = _run_id(flow_run_id)
    store = _store(stack)
    stopped: dict = {}
    try:
        _wait_key(store, f"runs/{run_id}/faults/held-e0-r0-")
        _idle_status(store, run_id, rank=1, epoch=0)
        victim = next(c for c in _containers(run_id, running_only=True)
                      if "-warm-r1-" in c.labels.get("io.prefect.flow-run-name", ""))
        stop = threading.Thread(target=lambda: stopped.update(_preempt_rank(run_id, 1, grace_s=120)[1]))
        stop.start()
        noticed = _status_with(store, run_id, "r1-", noticed_at=...)
        assert noticed["state"] == "idle" and noticed["epoch"] == 0, noticed  # still serving, not gone
        store.put(f"runs/{run_id}/release", b"1")  # epoch 0 ends; rank 1 trains epoch 1 through its notice
        _status_with(store, run_id, "spare-", state="idle", ready_at=...)  # its successor is ready
        store.put(f"runs/{run_id}/ready", b"1")
        fr = _wait_final(flow_run_id)
        stop.join(150)
    finally:
        store.put(f"runs/{run_id}/release", b"1")  # never hang
        store.put(f"runs/{run_id}/ready", b"1")
        store.close()
    assert stopped["exit_code"] == 6 and not stopped["killed"], stopped  # its own status, within the grace
    assert fr.state.is_completed(), fr.state.message
    summary = _summary(stack, run_id)
    assert summary["status"] == "completed" and len(summary["epochs"]) == 8
    assert all(r["failure"]["kind"] == "preempted" for e in summary["epochs"] for r in e["relaunches"])
    assert summary["spot"]["preemptions"] == 1 and summary["spot"]["saved_usd"] > 0
    # rank 1's place went to the successor started at its notice: no other worker was started
    assert _worker_flow_runs(run_id) == ["r0-w0", "r1-w1", "spare-w2"]
    rows = _ledger(stack, run_id)
    preempted = [r for r in rows if r["status"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["resource"].endswith(victim.id[:12]) and preempted[0]["usd"] > 0
    workers = [r for r in rows if r["kind"] in ("worker", "failed_attempt")]
    assert len({r["resource"] for r in workers}) == len(workers) == 3  # each container billed once
    assert _containers(run_id) == []

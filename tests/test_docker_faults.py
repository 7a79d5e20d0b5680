"""The docker target under faults (`tests/docker_stack.py`'s stack): a killed worker container is
replaced and its attempt billed, a SIGKILLed coordinator's containers stop within their lease. (A
cancelled run's and a straggler's containers: `tests/test_docker_cleanup.py`, a file of its own so
that the suite's processes share the docker tests.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import stop_process_group
from tests.docker_stack import ROOT, _client, _containers, _held_run, _ledger, _save_target, _store, _summary, _wait_final, stack_for_the_module

pytestmark = [pytest.mark.slow, pytest.mark.docker]
stack = pytest.fixture(scope="module", name="stack")(stack_for_the_module)


def test_a_killed_worker_container_is_replaced_and_its_attempt_billed(stack):
    """`podman kill` the rank-1 container while epoch 1 holds it (an event: the held marker)."""
    flow_run_id, run_id, store = _held_run(stack, epoch=1, rank=1, epochs=2)
    try:
        flow_runs = {c.labels.get("io.prefect.flow-run-name", ""): c for c in _containers(run_id, running_only=True)}
        victim = next(c for name, c in flow_runs.items() if "-warm-r1-" in name)
        subprocess.run(["podman", "kill", victim.id], check=True, capture_output=True,
                       env={**os.environ, "CONTAINERS_CONF": str(stack["home"] / "engine" / "containers.conf")})
        fr = _wait_final(flow_run_id)
        store.put(f"runs/{run_id}/release", b"1")  # nothing should be held by then; never hang
    finally:
        store.close()
    assert fr.state.is_completed(), fr.state.message
    summary = _summary(stack, run_id)
    assert summary["status"] == "completed" and len(summary["epochs"]) == 2
    assert any(r["rank"] == 1 for r in summary["epochs"][1]["relaunches"])
    rows = _ledger(stack, run_id)
    failed = [r for r in rows if r["kind"] == "failed_attempt"]
    assert failed and failed[0]["resource"].endswith(victim.id[:12]) and failed[0]["usd"] > 0
    assert _containers(run_id) == []


@pytest.fixture(scope="module", autouse=True)
def long_coordinator(stack):
    """A command-line coordinator of a run held mid-way, started with the module so that its
    workers' containers start while the other test's run trains: (process, its seed, the run
    keys before it). Both workers train epoch 0, then hold at the start of epoch 1 (beating,
    reading their lease, using no CPU to speak of, so the rest of the suite is not slowed by a
    run that trains for minutes) until the SIGKILL test kills the coordinator; where that test
    did not run (deselected), it is stopped here as a user would, by SIGTERM, so that it tears
    its containers down itself."""
    env = {**stack["env"], "PREFECT_API_URL": stack["api_url"]}
    hold = ",".join(f"hold_worker:epoch=1:rank={rank}:until=never" for rank in (0, 1))
    target = _save_target("docker-hold-long", job_variables={"env": {"ZOOID_CHAOS": hold}})
    seed = uuid.uuid4().int % 10**9  # tells this run apart from the other runs on the session's stack
    store = _store(stack)
    try:
        before = set(store.list("runs/"))
    finally:
        store.close()
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "flows.train", "--param", f"target={target}", "--param", "workers=2",
         "--param", "epochs=3", "--param", "worker_lease_s=15", "--param", "batch_size=64",
         "--param", f"seed={seed}", "--param", f"store={stack['docker']['store']}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield coordinator, seed, before
    finally:
        stop_process_group(coordinator, timeout=180)  # SIGTERM, SIGKILL only if it has not ended by then


def test_containers_of_a_sigkilled_coordinator_stop_within_their_lease(stack, long_coordinator):
    """SIGKILL a command-line coordinator mid-run: no one renews the lease, so each worker
    container stops itself (the lease expires) and exits."""
    coordinator, seed, before = long_coordinator
    store = _store(stack)
    try:
        deadline = time.monotonic() + 600
        run_id = None
        while run_id is None and time.monotonic() < deadline:  # a warm worker of this run replied to an epoch
            assert coordinator.poll() is None, "the coordinator ended early"
            for key in set(store.list("runs/")) - before:
                if "/warm/" in key and "/reply-" in key and _seed_of(store, key.split("/")[1]) == seed:
                    run_id = key.split("/")[1]
            time.sleep(0.3)
        assert run_id, "no worker container replied"
        running = {c.id for c in _containers(run_id, running_only=True)}
        assert running  # (a relaunch under load may be under way for the other rank)
    finally:
        os.killpg(coordinator.pid, signal.SIGKILL)
        coordinator.wait()
        store.close()
    try:
        deadline = time.monotonic() + 180
        while _containers(run_id, running_only=True) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _containers(run_id)
        assert left and not [c for c in left if c.status == "running"]
        logs = [c.logs().decode(errors="replace") for c in left if c.id in running]  # those running at the kill
        assert logs and all("lease was not renewed" in text for text in logs), logs[0][-2000:]
    finally:
        client = _client()
        try:  # the run's leftovers (exited, nothing billed past their stop) are swept by label, pass or fail
            from clouds.docker import sweep

            sweep(client, run_id)
        finally:
            client.close()


def _seed_of(store, run_id: str) -> int | None:
    """The seed of run `run_id`'s job (its run document), None before it is written."""
    from core.keys import run_doc_key

    try:
        return json.loads(store.get(run_doc_key(run_id)))["job"]["seed"]
    except KeyError:
        return None

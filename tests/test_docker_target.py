"""The docker target end to end: a real Prefect server, the process pool's coordinator, a Prefect
Docker worker starting each Zooid worker as a container of the worker image on podman's Docker
API, an S3 server the containers reach over the network, and the bill from the engine's clock.

One stack serves the module (`python -m deployments.stack up --docker` in a home of its own);
`make test` builds the image first (`make image`), so the stack only finds it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.docker]

JOB = {"batch_size": 32, "dataset": "digits", "worker_lease_s": 20}


def _engine_available() -> bool:
    return bool(shutil.which("podman") or os.environ.get("DOCKER_HOST"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The local stack with its container half, up for the module; down (by pid) after it."""
    if not _engine_available():
        pytest.skip("no container engine (make test installs podman)")
    home = tmp_path_factory.mktemp("docker-stack")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DOCKER_HOST"))}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    proc = subprocess.run([sys.executable, "-m", "deployments.stack", "up", "--docker"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    state_path = home / "stack.json"
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        state = json.loads(state_path.read_text())
        saved = {k: os.environ.get(k) for k in state["env"]}
        os.environ.update(state["env"])
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: state["api_url"]}):
            yield {**state, "home": home, "env": {**env, **state["env"]}}
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        subprocess.run([sys.executable, "-m", "deployments.stack", "down"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120)


def _client():
    from clouds.docker import docker_client

    return docker_client()


def _containers(run_id: str, running_only: bool = False) -> list:
    from clouds.docker import run_containers

    client = _client()
    try:
        found = run_containers(client, run_id)
        return [c for c in found if c.status == "running"] if running_only else found
    finally:
        client.close()


def _store(stack):
    from blocks.store import open_store_ref
    from blocks.store_block import block_ref

    return open_store_ref(block_ref(stack["docker"]["store"]))


def _submit(stack, **params) -> str:
    from prefect.deployments import run_deployment

    params = {**JOB, "store": stack["docker"]["store"], **params}
    return str(run_deployment("train/docker", parameters=params, timeout=0).id)


def _wait_final(flow_run_id: str, timeout_s: float = 600):
    from prefect.client.orchestration import get_client

    from deployments.stack import wait_final

    with get_client(sync_client=True) as client:
        return wait_final(client, flow_run_id, timeout_s, poll_s=0.5)


def _wait_key(store, prefix: str, timeout_s: float = 600) -> list[str]:
    """Keys under `prefix` once one exists (an event the workers write)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keys = store.list(prefix)
        if keys:
            return keys
        time.sleep(0.2)
    raise TimeoutError(f"nothing under {prefix} after {timeout_s:.0f} s")


def _summary(stack, run_id: str) -> dict:
    store = _store(stack)
    try:
        return json.loads(store.get(f"runs/{run_id}/summary.json", timeout=30))
    finally:
        store.close()


def _ledger(stack, run_id: str) -> list[dict]:
    store = _store(stack)
    try:
        return json.loads(store.get(f"runs/{run_id}/cost.json", timeout=30))["rows"]
    finally:
        store.close()


def _run_id(flow_run_id: str) -> str:
    from tasks.context import run_id_for

    return run_id_for(flow_run_id)


def _save_target(name: str, **changes) -> str:
    from blocks.compute import BUILTIN, ComputeTarget

    ComputeTarget(**{**BUILTIN["docker"], **changes}).save(name, overwrite=True)
    return name


def _held_run(stack, epoch: int, rank: int, epochs: int):
    """Submit a 2-worker Local-SGD run whose rank `rank` holds at the start of `epoch` until the
    key `release` exists; return (flow run id, run id, its store) once the hold began."""
    target = _save_target(f"docker-hold-e{epoch}r{rank}", job_variables={"env": {
        "ZOOID_CHAOS": f"hold_worker:epoch={epoch}:rank={rank}:until=release"}})
    flow_run_id = _submit(stack, strategy="local_sgd", workers=2, epochs=epochs, target=target)
    run_id = _run_id(flow_run_id)
    store = _store(stack)
    _wait_key(store, f"runs/{run_id}/faults/held-e{epoch}-r{rank}-")
    return flow_run_id, run_id, store


def _container_ids(rows: list[dict]) -> set[str]:
    return {r["resource"].split()[-1] for r in rows if r["kind"] in ("worker", "failed_attempt")}


@pytest.mark.parametrize("strategy, workers", [("local_sgd", 2), ("pipeline", 2)])
def test_training_on_containers_completes_warm_and_is_billed_on_the_engines_clock(stack, strategy, workers):
    params = {"strategy": strategy, "epochs": 2, "workers": workers}
    if strategy == "pipeline":
        params.update(workers=1, stages=2, model="digits_mlp")
    fr = _wait_final(_submit(stack, **params))
    assert fr.state.is_completed(), fr.state.message
    run_id = _run_id(str(fr.id))
    summary = _summary(stack, run_id)
    assert summary["status"] == "completed" and len(summary["epochs"]) == 2
    assert summary["final_accuracy"] > 0.5
    rows = _ledger(stack, run_id)
    workers_rows = [r for r in rows if r["kind"] == "worker"]
    # warm: one container per worker lived through both epochs, each billed once on the engine's clock
    ids = _container_ids(rows)
    assert len(ids) == 2 and all(len(i) == 12 and int(i, 16) >= 0 for i in ids)
    assert len({r["worker"] for r in workers_rows}) == 2
    assert all(r["stop"] >= r["start"] and r["usd"] == pytest.approx((r["stop"] - r["start"]) * r["unit_price_per_s"])
               for r in workers_rows)
    # the report names each worker's container: the text report's line and the UI artifact's bill
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.report import artifact_key, infrastructure_ids

    assert set(infrastructure_ids(rows)) == ids
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[artifact_key(run_id, "report")])))
    assert artifacts and all(i in artifacts[0].data for i in ids)
    # teardown read the clock, then removed every container of the run
    assert _containers(run_id) == []


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


def test_containers_of_a_sigkilled_coordinator_stop_within_their_lease(stack):
    """SIGKILL a command-line coordinator mid-run: no one renews the lease, so each worker
    container stops itself (the lease expires) and exits."""
    env = {**stack["env"], "PREFECT_API_URL": stack["api_url"]}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "flows.train", "--param", "target=docker", "--param", "workers=2",
         "--param", "epochs=200", "--param", "worker_lease_s=8", "--param", "batch_size=32",
         "--param", f"store={stack['docker']['store']}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    store = _store(stack)
    try:
        before = set(store.list("runs/"))
        deadline = time.monotonic() + 600
        run_id = None
        while run_id is None and time.monotonic() < deadline:  # a warm worker replied to an epoch
            assert coordinator.poll() is None, "the coordinator ended early"
            for key in set(store.list("runs/")) - before:
                if "/warm/" in key and "/reply-" in key:
                    run_id = key.split("/")[1]
            time.sleep(0.3)
        assert run_id, "no worker container replied"
        assert len(_containers(run_id, running_only=True)) == 2
    finally:
        os.killpg(coordinator.pid, signal.SIGKILL)
        coordinator.wait()
        store.close()
    deadline = time.monotonic() + 180
    while _containers(run_id, running_only=True) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _containers(run_id)
    assert left and not [c for c in left if c.status == "running"]
    logs = [c.logs().decode(errors="replace") for c in left]
    assert all("lease was not renewed" in text for text in logs), logs[0][-2000:]
    client = _client()
    try:  # the run's leftovers (exited, nothing billed past their stop) are swept by label
        from clouds.docker import sweep

        sweep(client, run_id)
    finally:
        client.close()


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
    assert fr.state.is_cancelled() or fr.state.is_failed() or fr.state.is_crashed()
    assert _containers(run_id) == []


def test_teardown_sweeps_a_container_left_behind_by_label(stack):
    from types import SimpleNamespace

    from blocks.compute import resolve_target
    from planners.catalog import get_offer
    from tasks.context import RunContext
    from tasks.job import TrainJob
    from tasks.teardown import teardown_run

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


def test_a_missing_image_or_engine_is_one_clear_error_before_anything_is_paid(stack, monkeypatch):
    from blocks.compute import resolve_target
    from core.errors import ZooidValueError
    from tasks.job import TrainJob
    from tasks.validate import check_target_ready, validate_job

    target = _save_target("docker-no-image", image="localhost/zooid-no-such-image:0")
    flow_run_id = _submit(stack, workers=2, epochs=1, target=target)
    fr = _wait_final(flow_run_id)
    assert fr.state.is_failed()
    assert "image: 'localhost/zooid-no-such-image:0' is not on the engine" in (fr.state.message or "")
    run_id = _run_id(flow_run_id)
    assert _containers(run_id) == []
    store = _store(stack)
    try:
        assert store.list(f"runs/{run_id}/") == []  # nothing written, nothing billed
    finally:
        store.close()

    resolved = validate_job(TrainJob(target="docker", store=stack["docker"]["store"]))
    assert resolve_target("docker").kind == "docker"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{stack['home']}/no-engine.sock")
    with pytest.raises(ZooidValueError, match=r"^target: no container engine answers at DOCKER_HOST="):
        check_target_ready(resolved)

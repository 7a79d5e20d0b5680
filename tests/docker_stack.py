"""The docker target's test stack and helpers, shared by `test_docker_target.py` and
`test_docker_faults.py`: a real Prefect server, the process pool's coordinator, a Prefect Docker
worker starting each Zooid worker as a container of the worker image on podman's Docker API, an
S3 server the containers reach over the network, and the bill from the engine's clock.

One stack serves the whole session (`python -m deployments.stack up --docker`, started by the
first test process that needs it and stopped once the last module that uses it is done:
`tests.shared_services`), so the two files, and
`test_local_stack_cancel.py` on its process pool, run side by side in several processes on it;
each run is told apart by its own run id. `make test` builds the image first (`make image`), so
the stack only finds it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.server import drain_prefect_clients, free_port
from tests.conftest import _file_of
from tests.shared_services import release_shared_service, shared_service

ROOT = Path(__file__).resolve().parent.parent
JOB = {"batch_size": 64, "dataset": "digits", "worker_lease_s": 20}  # 64: few steps through S3


def _engine_available() -> bool:
    return bool(shutil.which("podman") or os.environ.get("DOCKER_HOST"))


def _start_stack(home: Path) -> dict:
    """`python -m deployments.stack up --docker` with `home` as its ZOOID_HOME (for
    `tests.shared_services`): its state, and `deployments.stack down` to stop it."""
    env = _env(home)
    # a port of its own: the preferred 4200 may be another checkout's stack
    port = str(free_port(0))
    proc = subprocess.run([sys.executable, "-m", "deployments.stack", "up", "--docker", "--port", port],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"deployments.stack up --docker failed: {proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    state = json.loads((home / "stack.json").read_text())
    return {**state, "home": str(home),
            "stop": {"argv": [sys.executable, "-m", "deployments.stack", "down"], "env": env, "cwd": str(ROOT)}}


def _env(home: Path) -> dict[str, str]:
    """This process's environment without Prefect's settings or an engine, for the stack in `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DOCKER_HOST"))}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    return env


def stack_for_the_module(request):
    """The session's stack (started by the first test process that asks, stopped by the main
    process at the end), with its environment and Prefect API in force for one module. A test
    file makes it its module-scoped `stack` fixture:
    `stack = pytest.fixture(scope="module", name="stack")(stack_for_the_module)`."""
    if not _engine_available():
        pytest.skip("no container engine (make test installs podman)")
    state = shared_service(request.config, "stack", _start_stack)
    home = Path(state["home"])
    saved = {k: os.environ.get(k) for k in state["env"]}
    os.environ.update(state["env"])
    from prefect.settings import PREFECT_API_URL, temporary_settings

    try:
        with temporary_settings(updates={PREFECT_API_URL: state["api_url"]}):
            try:
                yield {**state, "home": home, "env": {**_env(home), **state["env"]}}
            finally:
                drain_prefect_clients()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        users = {_file_of(item.nodeid) for item in request.session.items if uses_the_shared_stack(item)}
        release_shared_service(request.config, "stack", _file_of(request.node.nodeid), users)


def uses_the_shared_stack(item) -> bool:
    """Whether a collected test uses the session's stack: its `stack` fixture is `stack_for_the_module`
    (a module's own fixture of that name, such as `test_refused_runs.py`'s local stack, is not; counted
    among the users, that file never released the stack, which then idled to the session's end)."""
    return any(d.func is stack_for_the_module for d in item._fixtureinfo.name2fixturedefs.get("stack", ()))


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
    from blocks.store_block import block_ref
    from blocks.store_refs import open_store_ref

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
    from coordinator.run.context import run_id_for

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

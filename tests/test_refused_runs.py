"""Issue 47: `make run` and every deployment run say why they stopped.

Bad input given to `make run`'s entry point (`python -m deployments.stack run --param ...`) is
refused in one line naming the field, exit 2, before anything starts: no stack, no Prefect
server, no container engine, no S3 server. On a stack that is up, a deployment run with bad
input (created as the UI's form creates one) ends Failed with that line as its state message,
and a run that fails after it started ends `make run` once it is final, with the run's own
message and where its logs are, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.server import drain_prefect_clients, free_port

ROOT = Path(__file__).resolve().parent.parent

REFUSED = [
    (["model=resnet99"], "model", "unknown model 'resnet99'; valid: "),
    (["wrokers=2"], "wrokers", "unknown parameter; valid: model, dataset, "),
    (["target=docker", "workers=0"], "workers", "greater than 0"),
    (["target=docker", "store=file:///tmp/zooid-47"], "store", "workers in containers"),
    # tests/test_refuse_before_paying.py's impossible pairs
    (["dataset=synthetic:3x32:10"], "model", "models that fit synthetic:3x32:10: none"),
    (["model=resnet18"], "model", "models that fit digits: digits_mlp, digits_cnn"),
    (["model=digits_cnn", "dataset=synthetic:64:20"], "model", "scores 10 classes, the dataset has 20"),
    (["model=tests.user_models:tiny_mlp", "dataset=synthetic:3x32x32:10"], "model", "a sample is 3x32x32"),
    # and tests/test_bad_input.py's kinds of bad values (each of its cases goes through the same
    # `coordinator.run.job_fields.check_fields` there, in `python -m flows.train`)
    (["lr=nan"], "lr", "finite number"),
    (["strategy=telepathy"], "strategy", ""),
    (["epochs"], "--param 'epochs'", "expected NAME=VALUE"),
]


def _env(home: Path) -> dict[str, str]:
    """This process's environment without Prefect's settings or an engine, for `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DOCKER_HOST"))}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    return env


def _stack_run(params: list[str], home: Path, port: int | None = None) -> subprocess.Popen:
    """`make run PARAMS=...`, as the Makefile runs it."""
    argv = [sys.executable, "-m", "deployments.stack", "run", *[a for p in params for a in ("--param", p)]]
    if port is not None:
        argv += ["--port", str(port)]
    return subprocess.Popen(argv, cwd=ROOT, env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)


def _processes_of(home: Path) -> list[int]:
    """Live processes whose environment names `home` as ZOOID_HOME: whatever a command with that
    home started (a server, a worker, an engine, an S3 server) inherits it."""
    mark = f"ZOOID_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every refused command at once (each with a home of its own and a port no one uses): by
    its case's index, (exit status, stdout, stderr, home, port)."""
    base = tmp_path_factory.mktemp("refused")
    done = {}
    for start in range(0, len(REFUSED), 4):  # four at a time: each imports torch
        batch = {}
        for i, (params, _, _) in enumerate(REFUSED[start:start + 4], start):
            home, port = base / f"case{i}" / "zooid", free_port(0)
            batch[i] = (_stack_run(params, home, port), home, port)
        for i, (proc, home, port) in batch.items():
            out, err = proc.communicate(timeout=300)
            done[i] = (proc.returncode, out, err, home, port)
    return done


@pytest.mark.parametrize("case", range(len(REFUSED)), ids=[" ".join(c[0]) for c in REFUSED])
def test_make_run_refuses_bad_input_in_one_line_before_anything_starts(refused, case):
    import socket

    params, field, says = REFUSED[case]
    code, out, err, home, port = refused[case]
    assert code == 2, out[-2000:] + err[-2000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), lines
    assert says in lines[0]
    assert "Traceback" not in out + err and out == ""
    # nothing started: no stack state, no log of any server, worker, engine or S3 server, no
    # Prefect database, no process left that the command started, nothing on its port
    assert not (home / "stack.json").exists() and not (home / "logs").exists()
    assert not list(home.rglob("*.db")) and not list(home.rglob("*.sock"))
    assert {p.name for p in home.iterdir()} <= {"prefect"} if home.exists() else True
    assert _processes_of(home) == []
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


# --- on a stack that is up ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One local stack (`python -m deployments.stack up`) for this module, its environment and
    Prefect API in force; stopped at the end."""
    home = tmp_path_factory.mktemp("stack47") / "zooid"
    env = _env(home)
    port = str(free_port(0))  # not the preferred 4200: another checkout's stack may hold it
    down = [sys.executable, "-m", "deployments.stack", "down"]
    try:
        up = subprocess.run([sys.executable, "-m", "deployments.stack", "up", "--port", port], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
        state = json.loads((home / "stack.json").read_text())
        saved = {k: os.environ.get(k) for k in state["env"]}
        os.environ.update(state["env"])
        from prefect.settings import PREFECT_API_URL, temporary_settings

        try:
            with temporary_settings(updates={PREFECT_API_URL: state["api_url"]}):
                try:
                    yield {**state, "home": home}
                finally:
                    drain_prefect_clients()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        subprocess.run(down, cwd=ROOT, env=env, capture_output=True, timeout=120)


def _flow_runs(flow: str) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        return {str(fr.id) for fr in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])))}


def _final(flow_run_id: str, timeout_s: float = 300):
    from prefect.client.orchestration import get_client

    from deployments.stack import wait_final

    with get_client(sync_client=True) as client:
        return wait_final(client, flow_run_id, timeout_s, poll_s=0.2)


ON_THE_STACK = [
    ({"model": "resnet99"}, "model"),
    ({"workers": 0}, "workers"),
    ({"model": "resnet18"}, "model"),
    ({"dataset": "synthetic:3x32:10"}, "model"),
    ({"target": "mars"}, "target"),
]


@pytest.mark.slow
def test_a_deployment_run_with_bad_input_fails_with_the_one_line_as_its_state_message(stack):
    """Created as the UI's form creates one (`create_flow_run_from_deployment` with its
    parameters): each run ends Failed, its state message is the refusal's one line (what the UI's
    run page shows), the same line is in its log, and it started no worker and made no run."""
    from prefect.client.orchestration import get_client

    from coordinator.run.context import run_id_for

    workers_before = _flow_runs("worker")
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train/local")
        ids = [str(client.create_flow_run_from_deployment(deployment.id, parameters=params).id)
               for params, _ in ON_THE_STACK]
    for flow_run_id, (params, field) in zip(ids, ON_THE_STACK):
        fr = _final(flow_run_id)
        assert fr.state.is_failed(), (params, fr.state)
        message = fr.state.message
        assert message.startswith(f"Flow run encountered an exception: ZooidValueError: {field}: "), message
        assert "\n" not in message
        with get_client(sync_client=True) as client:
            from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))
        assert any(log.message == f"error: {message.split('ZooidValueError: ', 1)[1]}" for log in logs)
        assert not (stack["home"] / "store" / "runs" / run_id_for(flow_run_id)).exists()
    assert _flow_runs("worker") == workers_before


@pytest.mark.slow
def test_watch_shows_the_refusal(stack):
    """`prefect deployment run ... --watch` stops at the Failed state; the refusal's line, logged
    and sent before the run fails, is in what it printed."""
    proc = subprocess.run([str(Path(sys.executable).with_name("prefect")), "deployment", "run", "train/local",
                           "--param", "model=resnet99", "--watch"], cwd=ROOT, env={**os.environ, **stack["env"]},
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Failed" in out, out[-3000:]
    assert "error: model: unknown model 'resnet99'" in " ".join(out.split()), out[-3000:]


@pytest.mark.slow
def test_make_run_on_a_running_stack_refuses_before_it_submits(stack):
    """With the stack up, `make run` checks through its API (a block-named target is looked up):
    one line, exit 2, no flow run submitted, the stack left as it was."""
    from deployments.server import alive

    trains = _flow_runs("train")
    for params, field in ((["model=resnet99"], "model"), (["target=mars"], "target")):
        proc = _stack_run(params, stack["home"])
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, out[-2000:] + err[-2000:]
        lines = _error_lines(err)
        assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), lines
        assert "Traceback" not in out + err
    assert _flow_runs("train") == trains
    assert all(alive(pid) for pid in stack["pids"].values())


@pytest.mark.slow
def test_make_run_ends_with_the_runs_own_message_once_a_started_run_fails(stack):
    """A run that passes the checks and fails after it started (its stage does not fit the
    worker's memory, found once profiled): `make run` ends when the flow run is final, not
    after waiting for a summary; it prints the run's own message and where its logs are, exit 2
    (input the run refused), no traceback."""
    trains = _flow_runs("train")
    proc = _stack_run(["worker_memory_gb=0.05", "epochs=1"], stack["home"])
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 2, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err and "did not appear" not in out + err
    [flow_run_id] = _flow_runs("train") - trains
    fr = _final(flow_run_id, 0)
    assert fr.state.is_failed()
    lines = _error_lines(err)
    assert lines[-2] == f"error: train/local run {fr.name!r} ended Failed: {fr.state.message}"
    assert "ZooidValueError: memory: " in lines[-2] and "worker has 51.2 MB" in lines[-2]
    assert lines[-1].startswith(f"logs: {stack['api_url'].removesuffix('/api')}/runs/flow-run/{flow_run_id} ")
    assert lines[-1].endswith(str(stack["home"] / "logs" / "worker.log"))

"""The local stack: a Prefect server on SQLite, the `zooid-local` process pool with one worker,
and the `train/local` and `worker/local` deployments.

    python -m deployments.stack up [--docker]   # start, leave running; writes .zooid/env
    python -m deployments.stack run [--param name=value ...]   # up if needed, run train/local, report, down
    python -m deployments.stack down    # stop what `up` started (by pid)

`--docker`, or a run with `target=docker`, adds the container half (`deployments.docker_stack`):
the engine's API, the worker image, an S3 server and its store block, the `zooid-docker` pool
and a Prefect Docker worker. A docker run without a `store` uses that S3 store.

Everything binds to 127.0.0.1, runs in its own process group, and lives under `$ZOOID_HOME`
(default `.zooid`): the Prefect home and database, results, logs, the store, and
`stack.json` with the pids that `down` stops.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from coordinator.job import RunSummary, parse_param_value
from coordinator.report import text_report
from core.keys import ledger_key, summary_key
from core.kinds import TargetKind
from deployments import docker_stack
from deployments.engine import down as engine_down
from deployments.prefect_db import seed_home
from deployments.server import (FLOW_FORKS_VAR, ROOT, alive, bin_path, free_port, server_command, spawn, stack_env,
                                stop_groups, wait_healthy, zooid_home)

POOL = "zooid-local"
FORKED_COMMAND = f"{shlex.quote(sys.executable)} -m flows.flow_forks"
"""The pool's command for a flow run: forked from the stack's fork server, already imported
(`flows.flow_forks`; without the server it runs `python -m prefect.engine` itself)."""


def _run(args: list[str], env: dict) -> None:
    subprocess.run(args, env={**os.environ, **env}, cwd=ROOT, check=True, stdin=subprocess.DEVNULL)


def _quiet(args: list[str], env: dict, log: Path) -> str:
    """Run `args` with its output kept in `log`, not on the terminal (`prefect deploy` ends
    each deployment with "start a worker in a separate terminal", which the stack already
    did); on failure, the output's tail is in the error. Returns the output."""
    done = subprocess.run(args, env={**os.environ, **env}, cwd=ROOT, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as fh:
        fh.write(done.stdout)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(args[1:3])} failed (exit {done.returncode}; all of it in {log}):\n{tail}")
    return done.stdout


DEPLOYMENTS = ("local", "nightly")
"""The deployments `up` deploys from prefect.yaml."""


@contextlib.contextmanager
def _stack_client(env: dict):
    """A sync Prefect client of the stack's API (`env`'s `PREFECT_API_URL`), for `up`'s checks."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            yield client


def _deployed(env: dict) -> list[str]:
    """`flow/name on pool` of each deployment of the stack's API, read back after `prefect deploy`."""
    with _stack_client(env) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return sorted(f"{flows.get(d.flow_id, '?')}/{d.name} on pool {d.work_pool_name}"
                      for d in client.read_deployments())


def _check_concurrency_limit(env: dict) -> int:
    """The paid-workers limit the flows take slots of (`coordinator.launchers.PAID_WORKERS_LIMIT`),
    read back from the stack's API: `deployments.bootstrap` creates it."""
    # coordinator.launchers imports Prefect, which reads its settings from the environment when
    # first imported: imported here, like Prefect itself, not with this module (see run_and_wait)
    from coordinator.launchers import PAID_WORKERS_LIMIT

    with _stack_client(env) as client:
        return client.read_global_concurrency_limit_by_name(PAID_WORKERS_LIMIT).limit


def _wait_worker_polling(env: dict, pid: int, since: float, log: Path, timeout_s: float = 120.0) -> None:
    """Wait until the pool's worker (`pid`, started at `since`) has reported to the API, which it
    does as it starts polling: a run submitted before then waited for the worker's own start-up
    (1.5 s measured from the first submit after `up`)."""
    deadline = time.monotonic() + timeout_s
    with _stack_client(env) as client:
        while time.monotonic() < deadline:
            if not alive(pid):
                raise RuntimeError(f"the {POOL} pool's worker exited (see {log})")
            if any(w.last_heartbeat_time and w.last_heartbeat_time.timestamp() >= since - 1.0
                   for w in client.read_workers_for_work_pool(POOL)):
                return
            time.sleep(0.2)
    raise RuntimeError(f"the {POOL} pool's worker did not report in {timeout_s:.0f} s (see {log})")


def state_file(home: Path) -> Path:
    return home / "stack.json"


def read_state(home: Path) -> dict | None:
    f = state_file(home)
    return json.loads(f.read_text()) if f.exists() else None


def up(home: Path | None = None, port: int | None = None, docker: bool = False) -> dict:
    """Start the stack (no-op when it is already up; `docker`: with its container half);
    return its state."""
    home = home or zooid_home()
    state = read_state(home)
    if state and all(alive(p) for p in state["pids"].values()):
        if docker and "docker" not in state:
            add_docker(home, state)
        return state
    if state:
        down(home)
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {**stack_env(home, api_url), "DOCKER_HOST": docker_stack.docker_host(home)}
    seed_home(Path(env["PREFECT_HOME"]), {**os.environ, **env})
    pids = {"server": spawn(server_command(port), {**env, "PREFECT_API_URL": ""}, home / "logs" / "server.log"),
            # the pool's flow runs fork from it (flows.flow_forks); its imports overlap the server's start
            "flow_forks": spawn([sys.executable, "-m", "flows.flow_forks", "serve", env[FLOW_FORKS_VAR]], env,
                                home / "logs" / "flow-forks.log")}
    state = {"api_url": api_url, "pids": pids, "env": env}
    state_file(home).write_text(json.dumps(state, indent=1))
    try:
        wait_healthy(api_url)
        time.sleep(1.0)
        if not alive(pids["server"]):  # the port was taken: another server answered
            raise RuntimeError(f"the Prefect server on port {port} did not start "
                               f"(see {home / 'logs' / 'server.log'}); is the port in use?")
        log = home / "logs" / "up.log"
        boot = json.loads(_quiet([sys.executable, "-m", "deployments.bootstrap", "--target", "local",
                                  "--command", FORKED_COMMAND], env, log).strip().splitlines()[-1])
        limit = _check_concurrency_limit(env)
        print(f"work pool {boot['work_pool']} {boot['pool']}; concurrency limit {boot['concurrency_limit']}: "
              f"{limit} paid worker(s)")
        names = [a for n in DEPLOYMENTS for a in ("--name", n)]
        _quiet([bin_path("prefect"), "--no-prompt", "deploy", *names], env, log)
        for deployment in _deployed(env):
            print(f"deployed {deployment}")
        spawned = time.time()
        pids["worker"] = spawn([bin_path("prefect"), "worker", "start", "--pool", POOL, "--type", "process"],
                                env, home / "logs" / "worker.log")
        state_file(home).write_text(json.dumps(state, indent=1))
        _wait_worker_polling(env, pids["worker"], spawned, home / "logs" / "worker.log")
        if docker:
            add_docker(home, state)
    except BaseException:
        down(home)
        raise
    (home / "env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return state


def add_docker(home: Path, state: dict) -> None:
    """Start the container half on the running stack and record it in `state`."""
    env = {**state["env"], "DOCKER_HOST": state["env"].get("DOCKER_HOST") or docker_stack.docker_host(home)}
    done = docker_stack.up(home, env, state["api_url"])
    state["pids"].update(done.pop("pids"))
    state["docker"] = done
    state_file(home).write_text(json.dumps(state, indent=1))


def down(home: Path | None = None) -> list[int]:
    """Stop what `up` started, by pid (process groups), and forget it."""
    home = home or zooid_home()
    state = read_state(home)
    if not state:
        return []
    pids = list(state["pids"].values())
    engine = state["pids"].get("engine")
    stop_groups([p for p in pids if p != engine])  # the engine last: its worker and containers first
    if engine is not None:
        engine_down(home)
    state_file(home).unlink(missing_ok=True)
    (home / "env").unlink(missing_ok=True)
    return pids


def run_deployed(params: dict, home: Path | None = None, timeout_s: float = 1800) -> dict:
    """Run `train/local` with `params` on the stack and return the run's summary (from the store)."""
    home = home or zooid_home()
    state = read_state(home)
    os.environ.update(state["env"])
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: state["api_url"]}):
        return run_and_wait(params, timeout_s)


def wait_final(client, flow_run_id, timeout_s: float, poll_s: float = 1.0):
    """The flow run once its state is final (read every `poll_s`); TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        fr = client.read_flow_run(flow_run_id)
        if fr.state and fr.state.is_final():
            return fr
        if time.monotonic() > deadline:
            raise TimeoutError(f"flow run {flow_run_id} still running after {timeout_s:.0f} s")
        time.sleep(poll_s)


def run_and_wait(params: dict, timeout_s: float, poll_s: float = 1.0) -> dict:
    """Submit `train/local` with `params`, wait until its flow run is final, and return the
    run's summary from the store, with the flow run's state and times and its ledger
    (`ledger`: cost.json) added."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    # Prefect reads its settings from the environment when first imported, so the modules that
    # import it are imported here, once run_deployed has put the stack's variables there.
    from blocks.store_refs import open_store_ref  # imports Prefect: see above
    from coordinator.context import run_id_for  # imports Prefect: see above
    from coordinator.validate import resolve_durable_ref, resolve_store_ref  # imports Prefect: see above

    submitted = time.time()
    flow_run = run_deployment("train/local", parameters=params, timeout=0)
    with get_client(sync_client=True) as client:
        fr = wait_final(client, flow_run.id, timeout_s, poll_s)
        seen = time.time()
    run_id = run_id_for(flow_run.id)
    store = open_store_ref(resolve_durable_ref(params.get("durable_store", ""),
                                           resolve_store_ref(params.get("store", ""))))
    try:
        summary = json.loads(store.get(summary_key(run_id), timeout=10))
        ledger = ledger_key(run_id)
        summary["ledger"] = json.loads(store.get(ledger, timeout=10)) if store.exists(ledger) else None
    finally:
        store.close()
    summary.update(flow_run_state=fr.state.type.value, submitted_at=submitted, seen_final_at=seen,
                   flow_start_at=fr.start_time.timestamp() if fr.start_time else None,
                   flow_end_at=fr.end_time.timestamp() if fr.end_time else None)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.stack", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "run", "status"])
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--port", type=int)
    parser.add_argument("--docker", action="store_true", help="also start the docker target's half")
    args = parser.parse_args(argv)
    if args.command == "up":
        state = up(port=args.port, docker=args.docker)
        print(f"Zooid stack up: Prefect UI at {state['api_url'].removesuffix('/api')}\n"
              f"  point a shell at it:  set -a; . {zooid_home() / 'env'}; set +a")
    elif args.command == "down":
        print(f"stopped pids {down()}")
    elif args.command == "status":
        print(json.dumps(read_state(zooid_home()), indent=1))
    else:
        params = {k: parse_param_value(v) for k, _, v in (p.partition("=") for p in args.param)}
        started_here = read_state(zooid_home()) is None
        docker = params.get("target") == TargetKind.DOCKER.builtin
        state = up(port=args.port, docker=docker or args.docker)
        if docker and not params.get("store"):  # containers reach the stack's S3 server, as on a cloud
            params["store"] = state["docker"]["store"]
        try:
            summary = run_deployed(params)
        finally:
            if started_here:
                down()
        state = summary.pop("flow_run_state")
        ledger = summary.pop("ledger")
        print(text_report(RunSummary(**{k: v for k, v in summary.items() if k in RunSummary.model_fields}), ledger))
        return 0 if state == "COMPLETED" and summary["status"] != "failed" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

from coordinator.report.report import text_report
from coordinator.run.job import RunSummary
from coordinator.run.job_fields import fields_from_args
from core.errors import ZooidError, ZooidValueError
from core.keys import ledger_key, summary_key
from core.kinds import TargetKind
from deployments import docker_stack
from deployments.engine import down as engine_down
from deployments.prefect_db import seed_home
from deployments.server import (
    FLOW_FORKS_VAR,
    ROOT,
    alive,
    bin_path,
    free_port,
    server_command,
    spawn,
    stack_env,
    stop_groups,
    wait_healthy,
    zooid_home,
)

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
    """The paid-workers limit the flows take slots of (`coordinator.workers.launchers.PAID_WORKERS_LIMIT`),
    read back from the stack's API: `deployments.bootstrap` creates it."""
    # coordinator.workers.launchers imports Prefect, which reads its settings from the environment when
    # first imported: imported here, like Prefect itself, not with this module (see run_and_wait)
    from coordinator.workers.launchers import PAID_WORKERS_LIMIT

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


TRAIN_DEPLOYMENT = "train/local"
DEPLOYMENT_DEFAULTS = {"target": TargetKind.PROCESS.builtin}
"""`train/local`'s own parameters (prefect.yaml): a run's fields are checked with them."""


class RunEnded(ZooidError):
    """A deployment run whose flow run ended other than Completed: its final state, its own
    message (first line), its summary where the run wrote one, and where its logs are."""

    def __init__(self, flow_run, summary: dict | None):
        from prefect.utilities.urls import url_for  # imports Prefect: see run_and_wait

        self.flow_run_id = str(flow_run.id)
        self.ui_url = url_for(flow_run)
        """The flow run's page in the stack's UI (Prefect's own link)."""
        self.state = flow_run.state.name
        self.message = ((flow_run.state.message or "").strip().splitlines() or ["(no message)"])[0]
        self.summary = summary
        super().__init__(f"{TRAIN_DEPLOYMENT} run {flow_run.name!r} ended {self.state}: {self.message}")

    @property
    def bad_input(self) -> bool:
        """Whether the run refused its input (a ZooidValueError or one of its kinds, named in the
        state message as Prefect writes it: `Flow run encountered an exception: <Type>: ...`)."""
        kinds, todo = set(), [ZooidValueError]
        while todo:
            kind = todo.pop()
            kinds.add(kind.__name__)
            todo.extend(kind.__subclasses__())
        return any(f"{kind}: " in self.message for kind in kinds)

    def logs(self, home: Path, stack_up: bool) -> str:
        """Where the flow run's logs are: the API (the UI's run page, `prefect flow-run logs`),
        with the stack up, and the pool worker's log file."""
        where = f"{self.ui_url} or `prefect flow-run logs {self.flow_run_id}`"
        return (f"logs: {where}{'' if stack_up else ' (after `make up`)'}; "
                f"the pool worker's output: {home / 'logs' / 'worker.log'}")


def _stored_summary(params: dict, run_id: str, timeout_s: float) -> dict | None:
    """The run's summary from its durable store, with its ledger (`ledger`: cost.json, or None);
    None when it wrote none (`timeout_s` 0: not waited for)."""
    # imports Prefect: see run_and_wait
    from blocks.store_refs import open_store_ref
    from coordinator.run.validate import resolve_durable_ref, resolve_store_ref

    store = open_store_ref(resolve_durable_ref(params.get("durable_store", ""),
                                               resolve_store_ref(params.get("store", ""))))
    try:
        if not timeout_s and not store.exists(summary_key(run_id)):
            return None
        summary = json.loads(store.get(summary_key(run_id), timeout=timeout_s))
        ledger = ledger_key(run_id)
        summary["ledger"] = json.loads(store.get(ledger, timeout=10)) if store.exists(ledger) else None
    finally:
        store.close()
    return summary


def run_and_wait(params: dict, timeout_s: float, poll_s: float = 1.0) -> dict:
    """Submit `train/local` with `params`, wait until its flow run is final, and return the
    run's summary from the store, with the flow run's state and times and its ledger
    (`ledger`: cost.json) added. A flow run that ends other than Completed raises `RunEnded`
    as soon as it is final, with the summary it wrote, if any."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    # Prefect reads its settings from the environment when first imported, so the modules that
    # import it are imported here, once run_deployed has put the stack's variables there.
    from coordinator.run.context import run_id_for  # imports Prefect: see above

    submitted = time.time()
    flow_run = run_deployment(TRAIN_DEPLOYMENT, parameters=params, timeout=0)
    with get_client(sync_client=True) as client:
        fr = wait_final(client, flow_run.id, timeout_s, poll_s)
        seen = time.time()
    run_id = run_id_for(flow_run.id)
    if not fr.state.is_completed():
        try:
            summary = _stored_summary(params, run_id, 0)
        except Exception:  # e.g. a store the run refused: the state's message says why
            summary = None
        raise RunEnded(fr, summary)
    summary = _stored_summary(params, run_id, 10)
    summary.update(flow_run_state=fr.state.type.value, submitted_at=submitted, seen_final_at=seen,
                   flow_start_at=fr.start_time.timestamp() if fr.start_time else None,
                   flow_end_at=fr.end_time.timestamp() if fr.end_time else None)
    return summary


def check_run_params(params: dict, home: Path, port: int | None) -> tuple[int | None, bool]:
    """Check a run's fields before anything starts, with the function the flow uses
    (`coordinator.run.job_fields.check_fields`); ZooidValueError naming the field. On a stack that is
    up, everything is checked through its API; else what needs no API (a block-named target or
    store is then left to the run), with the stack's environment already in place for the
    Prefect this imports (it reads its settings once). Returns (the port a new stack takes, or
    None where one is up; whether the stack is up)."""
    state = read_state(home)
    stack_up = bool(state) and all(alive(p) for p in state["pids"].values())
    docker = params.get("target") == TargetKind.DOCKER.builtin
    if stack_up:
        os.environ.update(state["env"])
    else:
        port = port or free_port()
        os.environ.update(stack_env(home, f"http://127.0.0.1:{port}/api"))
        home.mkdir(parents=True, exist_ok=True)  # Prefect makes its home (PREFECT_HOME, in it) on import
    from coordinator.run.job_fields import check_fields  # imports Prefect: see above

    check_fields({**DEPLOYMENT_DEFAULTS, **params}, api=stack_up and (not docker or "docker" in state))
    return (None if stack_up else port), stack_up


def run_command(param_args: list[str], port: int | None = None, docker: bool = False) -> int:
    """`run`: check the fields (bad input: one line naming the field, exit 2, nothing started),
    start the stack if it is not up, run `train/local`, print the report, stop what it started.
    A run that ends other than Completed prints its state's own message and where its logs are
    (exit 2 for input the run refused, else 1); nothing here prints a traceback for it."""
    home = zooid_home()
    try:
        params = fields_from_args(param_args)
        if params.get("target") == TargetKind.DOCKER.builtin and not params.get("store"):
            params["store"] = docker_stack.STORE_BLOCK  # containers reach the stack's S3 server, as on a cloud
        port, was_up = check_run_params(params, home, port)
    except ValueError as exc:  # ZooidValueError, and a --param without `=`
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ended = summary = None
    try:
        up(port=port, docker=params.get("target") == TargetKind.DOCKER.builtin or docker)
        summary = run_deployed(params)
    except RunEnded as exc:
        ended = exc
    except ZooidError as exc:  # e.g. no container engine, a summary that never came
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ZooidValueError) else 1
    except (TimeoutError, OSError, RuntimeError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if not was_up:
            down()
    if ended is not None:
        if ended.summary:
            ledger = ended.summary.pop("ledger", None)
            print(text_report(RunSummary(**{k: v for k, v in ended.summary.items() if k in RunSummary.model_fields}),
                              ledger))
        print(f"error: {ended}", file=sys.stderr)
        print(ended.logs(home, was_up), file=sys.stderr)
        return 2 if ended.bad_input else 1
    ledger = summary.pop("ledger")
    state = summary.pop("flow_run_state")
    print(text_report(RunSummary(**{k: v for k, v in summary.items() if k in RunSummary.model_fields}), ledger))
    return 0 if state == "COMPLETED" and summary["status"] != "failed" else 1


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
        return run_command(args.param, port=args.port, docker=args.docker)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Start one epoch's workers on a compute target, watch them, relaunch the ones that fail.

Two launchers with one interface (`launch(spec)`, `wait(timeout_s, on_failure)`, `stop()`):

- `InlineLauncher`: plain processes started by the coordinator (`python -m
  runtime.worker_main`, forked ready-imported by the run's `coordinator.workers.worker_forks`), each
  in its own process group and tagged with the run id.
- `PoolLauncher`: one `worker` flow run per worker through `run_deployment` on a work pool
  (local process pool, ECS, ACI, Kubernetes), polled with the sync client until final.

The coordinator measures each attempt's interval (launch to exit) for the bill. When an
attempt fails or outlives its timeout, `on_failure(outcome)` decides: return a spec to
relaunch that one worker (Prefect does not retry a crashed flow run, and retrying the whole
epoch would relaunch every worker), or None to stop the others at once and raise.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from blocks.store_block import BLOCK_PREFIX
from clouds.provider import resources_from_plan
from clouds.registry import adapter_for, is_cloud
from clouds.registry import job_variables as cloud_job_variables
from comm import heartbeat
from coordinator.workers.sweep import COORDINATOR_VAR, TAG_VAR, stop_pids
from coordinator.workers.worker_forks import WorkerForks
from core.errors import ZooidError
from core.kinds import CLOUD_KINDS, SHARED_HOST_KINDS, Capacity
from core.specs import WorkerResult, WorkerSpec

WORKER_MAIN = "runtime.worker_main"
"""A worker process's entry point (`runtime.fork_server` forks it ready-imported)."""

PAID_WORKERS_LIMIT = "zooid-paid-workers"
"""Global concurrency limit (Prefect) that caps paid workers across all runs: a cold worker
holds a slot for its epoch, a warm one from its start to its stop."""

FINAL = ("completed", "failed", "crashed", "timeout", "cancelled")
FAILED = ("failed", "crashed", "timeout")


@dataclass
class WorkerOutcome:
    """One worker attempt: where it ran, when, how it ended, and what it reported."""

    rank: int
    attempt: int
    started_at: float
    stopped_at: float | None = None
    status: str = "running"
    """running, completed, failed, crashed, timeout or cancelled."""
    result: WorkerResult | None = None
    """What the worker reported (`core.specs.WorkerResult`), once it completed."""
    error: str | None = None
    ref: str = ""
    """pid (inline) or flow run id (pool)."""
    extra: dict = field(default_factory=dict)
    """exit_code, log, failure classification, flow run times..."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class WorkersFailed(ZooidError, RuntimeError):
    """Some worker of the epoch did not complete and was not relaunched."""

    def __init__(self, outcomes: list[WorkerOutcome], reason: str = ""):
        self.outcomes = outcomes
        bad = [o for o in outcomes if o.status != "completed"]
        detail = "; ".join(f"rank {o.rank} attempt {o.attempt} {o.status}: {(o.error or '')[-300:]}"
                           for o in bad[:4])
        super().__init__(f"{reason or 'workers did not complete'}: {detail}")


class _Launcher:
    """Shared bookkeeping: attempts, per-attempt timeout, relaunch on failure."""

    poll_s = 0.05

    def __init__(self):
        self.attempts: list[tuple[Any, WorkerOutcome, WorkerSpec]] = []

    def launch(self, spec: WorkerSpec) -> WorkerOutcome:
        """Start one worker attempt for `spec`."""
        handle, outcome = self._start(spec)
        outcome.extra["capacity"] = spec.capacity  # what it is billed as (`coordinator.workers.preemptions`)
        self.attempts.append((handle, outcome, spec))
        return outcome

    @property
    def outcomes(self) -> list[WorkerOutcome]:
        return [o for _, o, _ in self.attempts]

    def wait(self, timeout_s: float,
             on_failure: Callable[[WorkerOutcome, WorkerSpec], WorkerSpec | None] | None = None,
             on_tick: Callable[[], None] | None = None) -> list[WorkerOutcome]:
        """Wait until the latest attempt of every rank completes. An attempt running longer
        than `timeout_s` is stopped (status `timeout`). A failed attempt is passed to
        `on_failure`; a returned spec is launched in its place, None stops everyone and
        raises WorkersFailed. A relaunch restarts every attempt's clock: survivors waiting at a
        sync for the relaunched peer are blocked, not hung."""
        last_relaunch = 0.0
        while True:
            self._poll()
            for handle, o, spec in list(self.attempts):
                alive_at = max(o.started_at, last_relaunch, self._last_progress(o))
                if o.status == "running" and time.time() - alive_at > timeout_s:
                    self._stop_one(handle, o, "timeout", f"still running after {timeout_s:.0f} s")
            handled = {id(o) for o in self.outcomes if o.extra.get("handled")}
            for handle, o, spec in list(self.attempts):
                if o.status in FAILED and id(o) not in handled:
                    o.extra["handled"] = True
                    try:
                        retry = on_failure(o, spec) if on_failure else None
                    except BaseException:  # e.g. out of memory: not retried, stop the rest
                        self.stop("stopped: another worker cannot be retried")
                        raise
                    if retry is None:
                        self.stop("stopped: another worker failed")
                        raise WorkersFailed(self.outcomes, f"rank {o.rank} {o.status}")
                    self.launch(retry)
                    last_relaunch = time.time()
                elif o.status == "cancelled" and id(o) not in handled:
                    self.stop("stopped: a worker was cancelled")
                    raise WorkersFailed(self.outcomes, "cancelled")
            latest = {}
            for _, o, _ in self.attempts:
                latest[o.rank] = o
            if all(o.status == "completed" for o in latest.values()):
                return [latest[r] for r in sorted(latest)]
            if on_tick is not None:
                on_tick()
            time.sleep(self.poll_s)

    def stop(self, reason: str = "stopped") -> None:
        """Stop every attempt still running."""
        for handle, o, _ in self.attempts:
            if o.status == "running":
                self._stop_one(handle, o, "cancelled", reason)

    # subclass hooks
    def _last_progress(self, outcome: WorkerOutcome) -> float:
        """Unix time of the attempt's last sign of progress (0: none known)."""
        return 0.0

    def _start(self, spec: WorkerSpec) -> tuple[Any, WorkerOutcome]:
        raise NotImplementedError

    def _poll(self) -> None:
        raise NotImplementedError

    def _stop_one(self, handle, outcome: WorkerOutcome, status: str, reason: str) -> None:
        raise NotImplementedError


class InlineLauncher(_Launcher):
    """Workers as child processes of the coordinator."""

    def __init__(self, run_id: str, log_dir: Path, env: dict[str, str] | None = None,
                 forks: WorkerForks | None = None):
        super().__init__()
        self.run_id = run_id
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = env or {}
        self.forks = forks

    def _start(self, spec: WorkerSpec):
        log = self.log_dir / f"e{spec.epoch}-r{spec.rank}-a{spec.attempt}.log"
        beat = log.with_suffix(".heartbeat")
        env = {**os.environ, **self.env, TAG_VAR: self.run_id, COORDINATOR_VAR: str(os.getpid()),
               heartbeat.ENV: str(beat)}
        entry = WORKER_MAIN
        if any(ref.startswith(BLOCK_PREFIX) for ref in (spec.store_url, spec.checkpoint_store)):
            from prefect.settings import PREFECT_API_URL

            entry = "flows.worker"  # loads the store block from the API: the secret stays in it
            env.setdefault("PREFECT_API_URL", PREFECT_API_URL.value() or "")
        argv = ["--spec-json", json.dumps(spec.to_dict())]
        launched = time.time()  # before the start: a forked worker can be ready before `start` returns
        proc = self.forks.start(argv, env, log) if self.forks is not None and entry == WORKER_MAIN else None
        if proc is None:
            with open(log, "wb") as out:
                proc = subprocess.Popen([sys.executable, "-m", entry, *argv], stdout=out, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
        outcome = WorkerOutcome(rank=spec.rank, attempt=spec.attempt, started_at=launched,
                                ref=str(proc.pid), extra={"log": str(log), "heartbeat": str(beat)})
        return proc, outcome

    def _last_progress(self, outcome: WorkerOutcome) -> float:
        return heartbeat.last_beat(outcome.extra["heartbeat"]) or 0.0

    def _poll(self) -> None:
        for proc, outcome, _ in self.attempts:
            if outcome.status != "running":
                continue
            code = proc.poll()
            if code is None:
                continue
            outcome.stopped_at = time.time()
            outcome.extra["exit_code"] = code
            text = Path(outcome.extra["log"]).read_text(errors="replace")
            if code == 0:
                try:
                    outcome.result = WorkerResult.from_dict(json.loads(text.strip().splitlines()[-1]))
                    outcome.status = "completed"
                except (ValueError, IndexError, TypeError):
                    outcome.status, outcome.error = "failed", "worker printed no result"
            else:
                outcome.status = "crashed" if code < 0 else "failed"
                outcome.error = f"exit {code}: " + text[-600:]

    def _stop_one(self, proc, outcome: WorkerOutcome, status: str, reason: str) -> None:
        stop_pids([proc.pid], grace_s=2.0)
        proc.wait()
        outcome.status, outcome.error, outcome.stopped_at = status, reason, time.time()
        outcome.extra["exit_code"] = proc.returncode


class PoolLauncher(_Launcher):
    """Workers as `worker` flow runs on a work pool, through `run_deployment`."""

    poll_s = 0.5

    infra_check_s = 2.0
    """How often a running flow run's infrastructure is looked at (where an adapter can)."""

    def __init__(self, run_id: str, deployment: str, job_variables: dict | None = None,
                 rank_job_variables: Callable[[int, str], dict] | None = None, adapter=None,
                 capacity: str = Capacity.ON_DEMAND):
        super().__init__()
        self.adapter = adapter
        """The target's `clouds.adapter.CloudAdapter`: tells a worker whose container died
        under a flow run Prefect still shows running (None: Prefect's view only)."""
        self._infra_checked = 0.0
        self._polled_at = 0.0
        self.run_id = run_id
        self.deployment = deployment
        self.job_variables = job_variables or {}
        self.rank_job_variables = rank_job_variables
        """Job variables of worker `rank` on a capacity (`on_demand`, `spot`) where they differ by
        rank or capacity (per-stage sizes, a cloud's spot settings), else None: `job_variables`."""
        self.capacity = str(capacity)
        """The plan's capacity (`Plan.capacity`): what `variables_of` asks for unless told."""

    def variables_of(self, rank: int, capacity: str | None = None) -> dict:
        """The job variables worker `rank` is launched with on `capacity` (None: the plan's)."""
        if self.rank_job_variables is None:
            return self.job_variables
        return self.rank_job_variables(rank, str(capacity or self.capacity))

    def _start(self, spec: WorkerSpec):
        from prefect.deployments import run_deployment

        variables = self.variables_of(spec.rank, spec.capacity)  # a replacement may run on another capacity
        env = {**variables.get("env", {}), TAG_VAR: self.run_id}
        flow_run = run_deployment(
            self.deployment, parameters={"spec": spec.to_dict()}, timeout=0,
            tags=run_tags(self.run_id, spec),
            job_variables={**variables, "env": env},
            flow_run_name=(f"{self.run_id}-warm-{spec.warm.worker}" if spec.warm is not None
                           else f"{self.run_id}-e{spec.epoch}-r{spec.rank}-a{spec.attempt}"))
        return flow_run.id, WorkerOutcome(rank=spec.rank, attempt=spec.attempt,
                                          started_at=time.time(), ref=str(flow_run.id))

    def _poll(self) -> None:
        """Read the running attempts' flow runs, at most every `poll_s`: a warm pool calls this
        from loops that read its store every 20 ms, and each read here is a request to the
        Prefect API per worker."""
        from prefect.client.orchestration import get_client

        if time.time() - self._polled_at < self.poll_s:
            return
        self._polled_at = time.time()
        check_infra = self.adapter is not None and time.time() - self._infra_checked >= self.infra_check_s
        if check_infra:
            self._infra_checked = time.time()
        with get_client(sync_client=True) as client:
            for run_id, outcome, spec in self.attempts:
                if outcome.status != "running":
                    continue
                fr = client.read_flow_run(run_id)
                state = fr.state
                if check_infra and state is not None and not state.is_final() and fr.infrastructure_pid:
                    self._check_infrastructure(client, fr, outcome)
                    continue
                if state is None or not state.is_final():
                    continue
                outcome.stopped_at = time.time()
                outcome.extra["flow_run_start"] = fr.start_time.timestamp() if fr.start_time else None
                outcome.extra["flow_run_end"] = fr.end_time.timestamp() if fr.end_time else None
                if state.is_completed() and spec.warm is not None:
                    outcome.status = "completed"  # a warm worker answers through the store, not its result
                elif state.is_completed():
                    try:
                        outcome.result = WorkerResult.from_dict(state.result())
                        outcome.status = "completed"
                    except Exception as exc:  # result storage unreadable
                        outcome.status, outcome.error = "failed", f"result unreadable: {exc}"
                elif state.is_cancelled():
                    outcome.status, outcome.error = "cancelled", state.message
                elif state.is_crashed():
                    outcome.status, outcome.error = "crashed", state.message
                else:
                    outcome.status, outcome.error = "failed", state.message

    def _check_infrastructure(self, client, fr, outcome: WorkerOutcome) -> None:
        """A flow run Prefect shows running whose container has ended is crashed: say so, in
        the outcome and in Prefect (nobody else will: the container cannot)."""
        from prefect.states import Crashed

        try:
            ended = self.adapter.ended(fr.infrastructure_pid)
        except Exception as exc:  # the engine blinked: look again next time
            print(f"zooid: could not read the infrastructure of {fr.name}: {type(exc).__name__}: {exc}")
            return
        if ended is None:
            return
        outcome.stopped_at = time.time()
        outcome.status, outcome.error = "crashed", ended["reason"]
        outcome.extra["exit_code"] = ended.get("exit_code")
        try:
            client.set_flow_run_state(fr.id, Crashed(message=ended["reason"]), force=True)
        except Exception:
            pass

    def _stop_one(self, run_id, outcome: WorkerOutcome, status: str, reason: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            try:
                client.set_flow_run_state(run_id, Cancelling(message=reason), force=True)
            except Exception:
                pass
        outcome.status, outcome.error, outcome.stopped_at = status, reason, time.time()


def worker_threads(kind: str, plan) -> int:
    """Torch threads per worker: the worker's own vCPU on a cloud target (a 4-vCPU container
    runs 4 threads), or this machine's cores divided among the plan's workers where they
    share it (never more than a container's CPU quota)."""
    own = max(1, int(plan.worker_vcpu + 1e-9))
    if kind in SHARED_HOST_KINDS:
        shared = max(1, (os.cpu_count() or 1) // max(1, plan.workers))
        return min(shared, own) if kind in CLOUD_KINDS else shared
    return own


def pool_default_env(work_pool: str | None) -> dict[str, str]:
    """The default `env` of the pool's base job template (e.g. where a container keeps its
    Prefect home and results); empty when the pool has none or cannot be read."""
    from prefect.client.orchestration import get_client

    if not work_pool:
        return {}
    try:
        with get_client(sync_client=True) as client:
            template = client.read_work_pool(work_pool).base_job_template or {}
    except Exception:  # no pool yet: the launch itself says so
        return {}
    default = template.get("variables", {}).get("properties", {}).get("env", {}).get("default")
    return dict(default) if isinstance(default, dict) else {}


def make_launcher(ctx, plan) -> _Launcher:
    """The launcher for the run's compute target (`ctx`: the run's `coordinator.run.context.RunContext`)."""
    target = ctx.resolved.target
    threads = worker_threads(target.kind, plan)
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if not target.remote:
        if ctx.state.forks is None:  # the run's fork server, started by its first worker
            ctx.state.forks = WorkerForks({**os.environ, TAG_VAR: ctx.run_id, COORDINATOR_VAR: str(os.getpid())},
                                          ctx.log_dir() / "fork-server.out")
        return InlineLauncher(ctx.run_id, ctx.log_dir(), env=env, forks=ctx.state.forks)
    if is_cloud(target):
        adapter = adapter_for(target)  # the provider's clock and stop, looked up once
        # a worker's `env` replaces the pool's default one: keep the pool's under ours (read once a
        # run: a launcher is made every epoch)
        if ctx.state.pool_env is None:
            ctx.state.pool_env = pool_default_env(target.work_pool)
        env = {**ctx.state.pool_env, **target.job_variables.get("env", {}), **env}

        peak = ctx.state.profile.get("peak_memory_bytes") if ctx.state.profile else None

        def variables(memory_gb: float | None, capacity: str, **margins) -> dict:
            resources = resources_from_plan(plan, profiled_memory_gb=memory_gb, gpu_type=ctx.resolved.offer.gpu_type,
                                            **margins)
            return cloud_job_variables(target.kind, resources, ctx.run_id, image=target.image,
                                       env=env, extra=target.job_variables, capacity=capacity)

        capacity = getattr(plan, "capacity", Capacity.ON_DEMAND)
        if plan.stage_memory_gb:  # the co-optimiser sized each stage: its worker asks for that size
            def of_rank(rank: int, capacity: str) -> dict:
                return variables(plan.memory_gb_of(rank), capacity, headroom=0.0, base_memory_gb=0.0)  # a tier
        elif target.kind in SHARED_HOST_KINDS:  # a container on this machine is exactly the size it is billed as
            def of_rank(rank: int, capacity: str) -> dict:
                return variables(plan.worker_memory_gb, capacity, headroom=0.0, base_memory_gb=0.0)
        else:  # a cloud container is right-sized to the profiled peak
            def of_rank(rank: int, capacity: str) -> dict:
                return variables(peak / 2**30 if peak else None, capacity)
        return PoolLauncher(ctx.run_id, target.worker_deployment, job_variables=of_rank(0, capacity),
                            rank_job_variables=functools.cache(of_rank), adapter=adapter, capacity=capacity)
    job_variables = {**target.job_variables, "env": {**target.job_variables.get("env", {}), **env}}
    return PoolLauncher(ctx.run_id, target.worker_deployment, job_variables=job_variables)


def run_tags(run_id: str, spec: WorkerSpec) -> list[str]:
    """A worker flow run's tags: `zooid-run:<id>` (teardown finds the run's flow runs by it) and
    `rank:<r>`; a cold worker runs one epoch, `epoch:<e>`, while a warm one serves every epoch
    it is sent, so it is tagged `warm` and each epoch it trains is a task run named after it
    (`flows.worker.train_epoch`: "epoch 3 rank 1 attempt 0")."""
    tags = [f"zooid-run:{run_id}", f"rank:{spec.rank}"]
    return tags + (["warm"] if spec.warm is not None else [f"epoch:{spec.epoch}"])


def launch_identity(launcher: _Launcher, rank: int = 0) -> str:
    """What worker `rank`'s launch depends on besides the run: its size and image (job
    variables without the environment, whose thread counts an epoch sets itself). Two plans
    whose launchers share it for a rank can keep that rank's warm worker."""
    variables = launcher.variables_of(rank) if isinstance(launcher, PoolLauncher) else {}
    return json.dumps({k: v for k, v in variables.items() if k != "env"}, sort_keys=True, default=str)

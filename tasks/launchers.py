"""Start one epoch's workers on a compute target and wait for them.

Two launchers with one interface (`launch(spec)`, `wait(timeout_s)`, `stop()`):

- `InlineLauncher`: plain processes started by the coordinator (`python -m
  training.worker_main`), each in its own process group and tagged with the run id.
- `PoolLauncher`: one `worker` flow run per worker through `run_deployment` on a work pool
  (local process pool, ECS, ACI, Kubernetes), polled with the sync client until final.

Either way the coordinator measures each worker's interval (launch to exit) for the bill,
and a failure of one worker stops the others at once instead of letting them wait at a sync.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.sweep import COORDINATOR_VAR, TAG_VAR, stop_pids
from training.specs import WorkerResult, WorkerSpec

FINAL = ("completed", "failed", "crashed", "timeout", "cancelled")


@dataclass
class WorkerOutcome:
    """One worker attempt: where it ran, when, how it ended, and what it reported."""

    rank: int
    attempt: int
    started_at: float
    stopped_at: float | None = None
    status: str = "running"
    """running, completed, failed, crashed, timeout or cancelled."""
    result: dict | None = None
    error: str | None = None
    ref: str = ""
    """pid (inline) or flow run id (pool)."""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(rank=self.rank, attempt=self.attempt, started_at=self.started_at,
                    stopped_at=self.stopped_at, status=self.status, result=self.result,
                    error=self.error, ref=self.ref, extra=self.extra)


class WorkersFailed(RuntimeError):
    """Some worker of the epoch did not complete (transient: the epoch may be retried)."""

    def __init__(self, outcomes: list[WorkerOutcome]):
        self.outcomes = outcomes
        bad = [o for o in outcomes if o.status != "completed"]
        detail = "; ".join(f"rank {o.rank} {o.status}: {(o.error or '')[-300:]}" for o in bad[:4])
        super().__init__(f"{len(bad)} of {len(outcomes)} workers did not complete: {detail}")


def _wait_loop(poll, outcomes: list[WorkerOutcome], timeout_s: float, stop, interval: float) -> list[WorkerOutcome]:
    deadline = time.monotonic() + timeout_s
    while True:
        poll()
        if any(o.status in ("failed", "crashed", "cancelled") for o in outcomes):
            stop("stopped: another worker failed")
            break
        if all(o.status in FINAL for o in outcomes):
            break
        if time.monotonic() > deadline:
            for o in outcomes:
                if o.status == "running":
                    o.status, o.error = "timeout", f"still running after {timeout_s:.0f} s"
            stop("stopped: timeout")
            break
        time.sleep(interval)
    if any(o.status != "completed" for o in outcomes):
        raise WorkersFailed(outcomes)
    return outcomes


class InlineLauncher:
    """Workers as child processes of the coordinator."""

    def __init__(self, run_id: str, log_dir: Path, env: dict[str, str] | None = None):
        self.run_id = run_id
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = env or {}
        self._procs: list[tuple[subprocess.Popen, WorkerOutcome, Path]] = []

    def launch(self, spec: WorkerSpec) -> WorkerOutcome:
        """Start one worker process for `spec`."""
        log = self.log_dir / f"e{spec.epoch}-r{spec.rank}-a{spec.attempt}.log"
        env = {**os.environ, **self.env, TAG_VAR: self.run_id, COORDINATOR_VAR: str(os.getpid())}
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "training.worker_main", "--spec-json",
                                     json.dumps(spec.to_dict())],
                                    stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        outcome = WorkerOutcome(rank=spec.rank, attempt=spec.attempt, started_at=time.time(),
                                ref=str(proc.pid), extra={"log": str(log)})
        self._procs.append((proc, outcome, log))
        return outcome

    def _poll(self) -> None:
        for proc, outcome, log in self._procs:
            if outcome.status != "running":
                continue
            code = proc.poll()
            if code is None:
                continue
            outcome.stopped_at = time.time()
            outcome.extra["exit_code"] = code
            text = log.read_text(errors="replace") if log.exists() else ""
            if code == 0:
                try:
                    outcome.result = json.loads(text.strip().splitlines()[-1])
                    outcome.status = "completed"
                except (ValueError, IndexError):
                    outcome.status, outcome.error = "failed", "worker printed no result"
            else:
                outcome.status = "crashed" if code < 0 else "failed"
                outcome.error = f"exit {code}: " + text[-600:]

    def wait(self, timeout_s: float) -> list[WorkerOutcome]:
        """Wait for every launched worker; on a failure stop the rest and raise WorkersFailed."""
        outcomes = [o for _, o, _ in self._procs]
        return _wait_loop(self._poll, outcomes, timeout_s, self.stop, 0.05)

    def stop(self, reason: str = "stopped") -> None:
        """Stop every worker still running (by pid, process group first)."""
        running = [(p, o) for p, o, _ in self._procs if p.poll() is None]
        stop_pids([p.pid for p, _ in running], grace_s=2.0)
        for p, o in running:
            p.wait()
            if o.status == "running":
                o.status, o.error, o.stopped_at = "cancelled", reason, time.time()
        self._poll()


class PoolLauncher:
    """Workers as `worker` flow runs on a work pool, through `run_deployment`."""

    def __init__(self, run_id: str, deployment: str, job_variables: dict | None = None,
                 poll_s: float = 0.5):
        self.run_id = run_id
        self.deployment = deployment
        self.job_variables = job_variables or {}
        self.poll_s = poll_s
        self._runs: list[tuple[Any, WorkerOutcome]] = []

    def launch(self, spec: WorkerSpec) -> WorkerOutcome:
        """Create one worker flow run; returns at once (the pool's worker picks it up)."""
        from prefect.deployments import run_deployment

        env = {**self.job_variables.get("env", {}), TAG_VAR: self.run_id}
        flow_run = run_deployment(
            self.deployment, parameters={"spec": spec.to_dict()}, timeout=0,
            tags=[f"zooid-run:{self.run_id}", f"epoch:{spec.epoch}", f"rank:{spec.rank}"],
            job_variables={**self.job_variables, "env": env},
            flow_run_name=f"{self.run_id}-e{spec.epoch}-r{spec.rank}-a{spec.attempt}")
        outcome = WorkerOutcome(rank=spec.rank, attempt=spec.attempt, started_at=time.time(),
                                ref=str(flow_run.id))
        self._runs.append((flow_run.id, outcome))
        return outcome

    def _poll(self) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            for run_id, outcome in self._runs:
                if outcome.status != "running":
                    continue
                fr = client.read_flow_run(run_id)
                state = fr.state
                if state is None or not state.is_final():
                    continue
                outcome.stopped_at = time.time()
                outcome.extra["flow_run_start"] = fr.start_time.timestamp() if fr.start_time else None
                outcome.extra["flow_run_end"] = fr.end_time.timestamp() if fr.end_time else None
                if state.is_completed():
                    try:
                        outcome.result = state.result()
                        outcome.status = "completed"
                    except Exception as exc:  # result storage unreadable
                        outcome.status, outcome.error = "failed", f"result unreadable: {exc}"
                elif state.is_cancelled():
                    outcome.status, outcome.error = "cancelled", state.message
                elif state.is_crashed():
                    outcome.status, outcome.error = "crashed", state.message
                else:
                    outcome.status, outcome.error = "failed", state.message

    def wait(self, timeout_s: float) -> list[WorkerOutcome]:
        """Wait for every worker flow run; on a failure cancel the rest and raise WorkersFailed."""
        outcomes = [o for _, o in self._runs]
        return _wait_loop(self._poll, outcomes, timeout_s, self.stop, self.poll_s)

    def stop(self, reason: str = "stopped") -> None:
        """Cancel every worker flow run that is not final yet."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            for run_id, outcome in self._runs:
                if outcome.status == "running":
                    try:
                        client.set_flow_run_state(run_id, Cancelling(message=reason), force=True)
                    except Exception:
                        pass
                    outcome.status, outcome.error, outcome.stopped_at = "cancelled", reason, time.time()


def worker_result(outcome: WorkerOutcome) -> WorkerResult:
    """The typed result a completed worker reported."""
    return WorkerResult.from_dict(outcome.result or {})

"""Honest end states: a cancelled run is `cancelled` everywhere; the bill the report shows is
the one cost.json keeps, whatever ended the run; a command line stopped by a signal says in
three lines what it tore down, what it cost and how to resume, and exits 128 + the signal.

Runs against a real Prefect API with the inline target and a directory store. Events order
the tests (a run's history file appearing, a process exiting), never sleeps.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coordinator.run.job import TrainJob

ROOT = Path(__file__).resolve().parent.parent


def _until(found, until: float, alive, what: str):
    """Poll `found()` until it returns something (an event the run writes or prints)."""
    while time.monotonic() < until:
        hit = found()
        if hit:
            return hit
        assert alive(), f"the run ended before {what}"
        time.sleep(0.05)
    raise AssertionError(f"no {what}")


def _wait_for(path_glob, root: Path, until: float, alive=lambda: True) -> Path:
    """The first file matching `path_glob` under `root` (an event the run writes)."""
    def found():
        return min(root.glob(path_glob), default=None) if root.exists() else None

    return _until(found, until, alive, f"{path_glob} under {root}")


def _wait_for_line(path: Path, pattern: str, until: float, alive=lambda: True) -> None:
    """Until `path` holds a line matching `pattern` (a line the run prints)."""
    _until(lambda: re.search(pattern, path.read_text(errors="replace")), until, alive, f"{pattern!r} in {path}")


def _ledger_and_summary(store_root: Path, run_id: str) -> tuple[dict, dict]:
    run = store_root / "runs" / run_id
    return json.loads((run / "cost.json").read_text()), json.loads((run / "summary.json").read_text())


def _only_run(store_root: Path) -> str:
    [run] = [p.name for p in (store_root / "runs").iterdir()]
    return run


# --- every end state: one bill ---------------------------------------------------------------


END_STATES = {
    "completed": dict(epochs=1),
    "target_reached": dict(epochs=4, target_accuracy=0.05),
    "budget_exhausted": dict(epochs=4, budget_usd=1e-9),
    "deadline_reached": dict(epochs=4, deadline_s=1e-3),
}


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("status", list(END_STATES) + ["failed"])
def test_the_report_and_cost_json_show_one_bill_whatever_ended_the_run(tmp_path, monkeypatch, status):
    """The final ledger is written before the report, marked final, and the failure hooks (which
    run after the flow's own teardown) leave it as it is: summary, report and cost.json agree."""
    from coordinator.workers.sweep import tagged_pids
    from flows.train import train

    store = tmp_path / "store"
    fields = END_STATES.get(status, dict(epochs=1))
    if status == "failed":
        monkeypatch.setenv("ZOOID_CHAOS", "oom_worker:epoch=0:rank=1:mode=kill")
    state = train(TrainJob(workers=2, store=f"file://{store}", batch_size=32, **fields), return_state=True)
    assert state.is_failed() == (status == "failed")
    run_id = _only_run(store)
    ledger, summary = _ledger_and_summary(store, run_id)
    assert summary["status"] == status
    assert ledger["final"] is True
    assert summary["total_cost_usd"] == ledger["total_usd"] == sum(r["usd"] for r in ledger["rows"])
    assert [r["kind"] for r in ledger["rows"]].count("coordinator") == 1
    assert tagged_pids(run_id) == []


@pytest.mark.usefixtures("prefect_api")
def test_a_hook_after_the_coordinator_billed_itself_does_not_rewrite_the_bill(tmp_path):
    """The runner's cancellation hook (another process, later) finds the final ledger and
    leaves it; without one (a killed coordinator) it bills the coordinator and says why the
    run ended."""
    from types import SimpleNamespace

    from prefect.states import Cancelling

    from comm.store import open_store
    from coordinator.bill.cost import write_ledger
    from coordinator.run.context import run_id_for
    from core.cost_record import CostRecord
    from flows.hooks import _rebuild_and_clean, end_status

    url = f"file://{tmp_path}/store"
    flow_run = SimpleNamespace(id="0123456789abcdef0123", start_time=None,
                               parameters={"job": {"store": url, "target": "inline"}})
    run_id = run_id_for(flow_run.id)
    store = open_store(url)
    row = CostRecord(run_id=run_id, resource="coordinator", kind="coordinator", offer="aci-cpu",
                     start=1.0, stop=3.0, unit_price_per_s=0.5)
    write_ledger(store, run_id, [row], final=True)
    before = store.get(f"runs/{run_id}/cost.json")
    _rebuild_and_clean(flow_run, Cancelling())
    assert store.get(f"runs/{run_id}/cost.json") == before
    write_ledger(store, run_id, [row], final=False)  # a coordinator killed mid-run
    _rebuild_and_clean(flow_run, Cancelling())
    ledger = json.loads(store.get(f"runs/{run_id}/cost.json"))
    summary = json.loads(store.get(f"runs/{run_id}/summary.json"))
    assert ledger["final"] is True and summary["status"] == "cancelled"
    assert summary["total_cost_usd"] == ledger["total_usd"]
    assert end_status(SimpleNamespace(type=SimpleNamespace(value="CRASHED"))) == "failed"


# --- cancelled ------------------------------------------------------------------------------


def _cancel_while_epoch_1_is_held(store: Path, flow_run_ids: list, done: threading.Event) -> threading.Thread:
    """What Prefect's runner does to cancel a run: the flow run is set Cancelling, the child is
    told the intent is `cancel` on its control channel, then it gets SIGTERM. Here it happens
    once rank 0 holds at the start of epoch 1 (`hold_worker`, set by the caller), so the flow
    is inside its epoch task, not between tasks (a cancel landing as Prefect sets up a task run
    fails that run with "Task run is not set" instead)."""
    from prefect._internal import control_listener
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    def cancel() -> None:
        try:
            _wait_for("runs/*/faults/held-e1-r0-*.json", store, time.monotonic() + 300)
            with get_client(sync_client=True) as client:
                [fr] = [f for f in client.read_flow_runs() if f.name and f.state and f.state.is_running()
                        and f.flow_id and client.read_flow(f.flow_id).name == "train"]
                flow_run_ids.append(fr.id)
                client.set_flow_run_state(fr.id, Cancelling(message="cancelled from the UI"), force=True)
            control_listener._set_intent("cancel")
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            done.set()

    thread = threading.Thread(target=cancel, daemon=True)
    thread.start()
    return thread


def _flow_run_lines(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                sort=LogSort.TIMESTAMP_ASC)
    return [log.message for log in logs]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("engine_owns", [True, False], ids=["in-process", "runner-owned"])
def test_a_run_cancelled_through_prefect_is_cancelled_everywhere(tmp_path, monkeypatch, request, engine_owns):
    """summary.json, RunSummary's status, the flow run's state and the flow log's last line all
    say cancelled; the bill is final and the hook the runner runs afterwards leaves it as it is.
    `runner-owned`: Prefect's runner owns the state and the hooks (as for a deployment run)."""
    from prefect._internal import control_listener
    from prefect.client.orchestration import get_client
    from prefect.exceptions import TerminationSignal

    from coordinator.workers.sweep import tagged_pids
    from flows.hooks import on_abnormal_end
    from flows.train import train

    if not engine_owns:
        monkeypatch.setenv("PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS", "false")
    monkeypatch.setenv("ZOOID_CHAOS", "hold_worker:epoch=1:rank=0:until=never:seconds=600")
    flow_logger = logging.getLogger("prefect.flow_runs")  # the suite logs warnings only
    request.addfinalizer(lambda level=flow_logger.level: flow_logger.setLevel(level))
    flow_logger.setLevel(logging.INFO)  # setLevel, not .level: it clears the loggers' cached answers
    store = tmp_path / "store"
    flow_run_ids, done = [], threading.Event()
    thread = _cancel_while_epoch_1_is_held(store, flow_run_ids, done)
    try:
        with pytest.raises(TerminationSignal):
            train(TrainJob(workers=2, epochs=500, store=f"file://{store}", batch_size=32))
    finally:
        done.wait(timeout=60)
        thread.join(timeout=10)
        control_listener.clear_intent()
    [flow_run_id] = flow_run_ids
    run_id = _only_run(store)
    ledger, summary = _ledger_and_summary(store, run_id)
    assert summary["status"] == "cancelled"
    assert "TerminationSignal" not in (summary["error"] or "")
    assert ledger["final"] is True and summary["total_cost_usd"] == ledger["total_usd"]
    assert tagged_pids(run_id) == []
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
    if engine_owns:
        assert flow_run.state.is_cancelled()
    else:  # the runner marks it Cancelled once the process is gone, after its hook
        assert flow_run.state.is_cancelling()
        before = (store / "runs" / run_id / "cost.json").read_bytes()
        on_abnormal_end(None, flow_run, flow_run.state)
        assert (store / "runs" / run_id / "cost.json").read_bytes() == before
    lines = _flow_run_lines(flow_run_id)
    assert any(f"run {run_id} cancelled" in line for line in lines), lines
    assert lines[-1].startswith("Finished in state Cancelled")


# --- the command line stopped by a signal ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_command_line_run_stopped_by_a_signal_says_three_lines_and_exits_128_plus_it(tmp_path, sig):
    """`python -m flows.train` on the inline target with a long job, stopped once its first
    epoch is in the store: after the signal it prints at most three lines (torn down, bill,
    resume), no traceback, exits 143 (SIGTERM) or 130 (SIGINT), and leaves nothing running."""
    from coordinator.workers.sweep import tagged_pids

    home = tmp_path / "zooid"
    out_path = tmp_path / "out.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PYTHONUNBUFFERED="1")
    with open(out_path, "wb") as out:
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "flows.train", "--param", "workers=2", "--param", "epochs=500",
             "--param", "batch_size=32"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    runs = home / "store" / "runs"
    try:
        alive = lambda: coordinator.poll() is None  # noqa: E731
        history = _wait_for("*/history.json", runs, time.monotonic() + 300, alive)
        # the step that wrote it logs its end after the file: wait for that line, then the run
        # is inside its next epoch and what it printed so far is Prefect's run log
        _wait_for_line(out_path, r"Task run 'save_progress-\w+' - Finished", time.monotonic() + 120, alive)
        before = out_path.stat().st_size
        if sig == signal.SIGINT:  # Ctrl-C: the terminal signals the whole foreground group
            os.killpg(coordinator.pid, sig)
        else:
            coordinator.send_signal(sig)
        coordinator.wait(timeout=300)
    finally:
        if coordinator.poll() is None:
            os.killpg(coordinator.pid, signal.SIGKILL)
            coordinator.wait()
    run_id = history.parent.name
    printed = out_path.read_bytes()
    after = [line for line in printed[before:].decode(errors="replace").splitlines() if line.strip()]
    assert coordinator.returncode == 128 + sig, printed.decode(errors="replace")[-3000:]
    assert "Traceback" not in printed.decode(errors="replace")
    assert 1 <= len(after) <= 3, after
    assert any("torn down" in line for line in after)
    ledger = json.loads((runs / run_id / "cost.json").read_text())
    from coordinator.report.progress import money

    assert any(f"bill so far: {money(ledger['total_usd'])}" in line for line in after), after
    assert any(f"--param resume={run_id}" in line for line in after), after
    assert ledger["final"] is True
    assert tagged_pids(run_id) == []
    summary = json.loads((runs / run_id / "summary.json").read_text())  # stopped by its user: cancelled
    assert summary["status"] == "cancelled" and summary["error"] == f"interrupted by {sig.name} on the command line"
    assert summary["total_cost_usd"] == ledger["total_usd"]


def test_a_noted_stop_is_raised_again_at_the_next_boundary():
    """A command line's stop signal, once noted, is raised again by the recipe's next boundary
    and by every poll of an epoch: a library that caught the first raise cannot keep the run
    training. Another process's run (not a command line) is not affected."""
    from flows.train_cli import CommandLine

    line = CommandLine()
    line.reset(active=True)
    line.raise_if_stopped()  # nothing noted: goes on
    line.signal = signal.SIGTERM  # as `stop` notes it (without quieting this test's console)
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
        line.raise_if_stopped()
    line.reset(active=False)
    line.signal = signal.SIGTERM
    line.raise_if_stopped()


def test_a_command_line_whose_flow_run_prefect_set_cancelling_stops(monkeypatch):
    """Where Prefect's own SIGTERM handler took the signal and set the flow run Cancelling, the
    command line notes the stop at its next check and raises it."""
    import prefect.client.orchestration as orchestration
    from prefect.states import Cancelling, Running

    from flows.train_cli import CommandLine

    states = [Running(), Cancelling()]

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read_flow_run(self, flow_run_id):
            return type("FlowRun", (), {"state": states.pop(0)})()

    monkeypatch.setattr(orchestration, "get_client", lambda sync_client: Client())
    monkeypatch.setattr("flows.train_cli._quiet_console", lambda: None)
    line = CommandLine()
    line.reset(active=True)
    line.raise_if_cancelling("fr", every_s=0.0)  # running: goes on
    with pytest.raises(KeyboardInterrupt):
        line.raise_if_cancelling("fr", every_s=0.0)
    assert line.signal == signal.SIGTERM

"""The provider's notice outside an epoch (`engine.preemption.leaving`): a worker that gets
SIGTERM while it starts, profiles or waits warm for its next command has nothing to hand over and
leaves at once, with the worker's own exit status (6), after a warm worker marked itself
preempted in its status for its pool; during an epoch the same handler defers to the epoch's flag
(`listening()`), from the main thread or another. Real processes, real signals; every wait is
for an event (a line on a pipe, a status written, a process exit)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.cost_record import CostRecord
from runtime.warm import read_json, status_key
from tests.test_warm_workers import _await_reply, _epoch_command, _launch, _publish_run

ROOT = Path(__file__).resolve().parent.parent


def _script(body: str) -> subprocess.Popen:
    """A Python process running `body`, its stdout a pipe (it prints `ready` when it waits)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)


def _signal_when_ready(proc: subprocess.Popen) -> None:
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)


def test_outside_an_epoch_the_notice_runs_the_hooks_and_exits_6_at_once(tmp_path):
    proc = _script(f"""
        import threading
        from engine import preemption
        def hook():
            open({str(tmp_path / 'left')!r}, "w").write("marked")
        with preemption.leaving():
            with preemption.leaving(hook):
                print("ready", flush=True)
                threading.Event().wait(600)
        print("never", flush=True)
    """)
    _signal_when_ready(proc)
    assert proc.wait(timeout=60) == 6
    assert (tmp_path / "left").read_text() == "marked" and "never" not in proc.stdout.read()


def test_during_an_epoch_the_notice_only_sets_the_flag_in_the_main_thread_or_another():
    proc = _script("""
        import threading, time
        from engine import preemption
        seen = []
        def epoch():
            with preemption.listening() as installed:
                seen.append(installed)
                print("ready", flush=True)
                while not preemption.requested():
                    time.sleep(0.01)
                seen.append("flag")
        with preemption.leaving():
            with preemption.listening() as installed:
                print("ready", flush=True)
                while not preemption.requested():
                    time.sleep(0.01)
            print("main", installed, flush=True)
            worker = threading.Thread(target=epoch)
            worker.start()
            while worker.is_alive():
                worker.join(0.05)
            print("thread", *seen, flush=True)
    """)
    _signal_when_ready(proc)
    assert proc.stdout.readline().split() == ["main", "True"]
    _signal_when_ready(proc)  # the epoch in a thread: the process-wide handler sets its flag
    assert proc.stdout.readline().split() == ["thread", "False", "flag"]
    assert proc.wait(timeout=60) == 0


def _status_when(store, run_id: str, worker: str, proc, **want) -> dict:
    """The worker's status once it has the `want` fields (an event it writes)."""
    while True:
        status = read_json(store, status_key(run_id, worker)) or {}
        if all(status.get(k) == v for k, v in want.items()):
            return status
        assert proc.poll() is None, f"worker exited with {proc.returncode}"
        time.sleep(0.02)


def test_a_warm_worker_idle_between_epochs_marks_itself_preempted_and_exits_6(dir_store, tmp_path):
    from coordinator.workers.warm_pool import LeaseRenewer

    run_id = "warmidle"
    _publish_run(dir_store, run_id)
    renewer = LeaseRenewer(lambda: type(dir_store)(dir_store.root), run_id, 0.2)
    renewer.start()
    proc = _launch(dir_store.url, run_id, "r0-w0", tmp_path / "w.log", lease_s=600)
    try:
        _epoch_command(dir_store, dir_store, run_id, "r0-w0", 0, 0)
        assert _await_reply(dir_store, run_id, "r0-w0", 0, proc)["ok"]
        idle = _status_when(dir_store, run_id, "r0-w0", proc, state="idle", epoch=0)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 6  # the worker's own status: it left, nothing killed it
    finally:
        renewer.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = read_json(dir_store, status_key(run_id, "r0-w0"))
    assert left["state"] == "preempted" and left["pid"] == proc.pid == idle["pid"]
    assert left["seq"] == 1 and left["epoch"] == 0 and left["left_at"] >= left["noticed_at"]
    assert read_json(dir_store, f"runs/{run_id}/warm/r0-w0/reply-1.json") is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("leave", ["released", "second notice"])
def test_a_warm_worker_with_notice_time_works_through_it_until_released(dir_store, tmp_path, leave):
    """With notice time (`WarmSpec.notice_s`, a spot offer's 120 s), the notice while idle does
    not end the worker: its status says `noticed_at` at once (still idle), it trains the next
    epoch it is sent, and only when its pool writes `release` (or a second SIGTERM comes: leave
    now) does it mark itself preempted and exit with the worker's own status 6."""
    from coordinator.workers.warm_pool import LeaseRenewer
    from core.keys import release_key

    run_id = "warmthrough"
    _publish_run(dir_store, run_id)
    renewer = LeaseRenewer(lambda: type(dir_store)(dir_store.root), run_id, 0.2)
    renewer.start()
    proc = _launch(dir_store.url, run_id, "r0-w0", tmp_path / "w.log", lease_s=600, notice_s=120)
    try:
        _epoch_command(dir_store, dir_store, run_id, "r0-w0", 0, 0)
        assert _await_reply(dir_store, run_id, "r0-w0", 0, proc)["ok"]
        _status_when(dir_store, run_id, "r0-w0", proc, state="idle", epoch=0)
        os.kill(proc.pid, signal.SIGTERM)
        noticed = _status_when(dir_store, run_id, "r0-w0", proc, state="idle", seq=1)
        while "noticed_at" not in noticed:  # written at once by its watch thread (an event)
            noticed = _status_when(dir_store, run_id, "r0-w0", proc, state="idle", seq=1)
        _epoch_command(dir_store, dir_store, run_id, "r0-w0", 1, 1)  # it works through the notice
        reply = _await_reply(dir_store, run_id, "r0-w0", 1, proc)
        assert reply["ok"] and reply["result"]["epoch"] == 1 and reply["began_at"] > noticed["noticed_at"]
        assert proc.poll() is None  # answered, and still serving: nobody released it
        if leave == "released":
            dir_store.put(release_key(run_id, "r0-w0"), b"{}")
        else:
            os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 6
    finally:
        renewer.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = read_json(dir_store, status_key(run_id, "r0-w0"))
    assert left["state"] == "preempted" and left["noticed_at"] == noticed["noticed_at"]
    assert left["left_at"] >= reply["ended_at"] and left["seq"] == 2


def test_working_through_the_notice_hands_over_when_released_or_when_its_time_is_spent(monkeypatch):
    """`engine.preemption.due`: without notice time a notice is due at once; while `overlapping`
    it is due once the pool released the worker or the working time is spent, and a wait for a
    peer ends on the notice only then."""
    from engine import preemption

    clock, released = [1000.0], [False]
    monkeypatch.setattr(preemption.time, "time", lambda: clock[0])
    preemption.reset()
    try:
        with preemption.overlapping(30.0, lambda: released[0]):
            assert not preemption.due()  # no notice yet
            preemption._on_sigterm(signal.SIGTERM, None)
            clock[0] = 1029.9
            assert preemption.requested() and not preemption.due()
            preemption.stop_waiting()  # waiting on a peer is still fine
            clock[0] = 1030.0
            assert preemption.due()
            with pytest.raises(preemption.NoticeWhileWaiting):
                preemption.stop_waiting()
        preemption.reset()
        with preemption.overlapping(30.0, lambda: released[0]):
            preemption._on_sigterm(signal.SIGTERM, None)
            assert not preemption.due()
            released[0] = True
            assert preemption.due()
        preemption.reset()
        with preemption.overlapping(0.0, lambda: False):  # no working time: as without the block
            preemption._on_sigterm(signal.SIGTERM, None)
            assert preemption.due()
    finally:
        preemption.reset()


def _row(**kw) -> CostRecord:
    base = dict(run_id="r", resource="worker r1-w1-abc", kind="worker", offer="fargate-spot", start=0.0, stop=5.0,
                unit_price_per_s=1e-5, status="preempted", rank=1, worker="flow-run-1", capacity="spot")
    return CostRecord(**{**base, **kw})


def test_a_warm_worker_preempted_idle_is_billed_once_as_preempted_on_the_clouds_clock():
    from coordinator.bill.cloud_bill import replace_measured

    coordinator = [_row(status="startup", stop=1.0), _row(status="idle", start=1.0, stop=4.0),
                   _row(start=4.0, stop=5.0), _row(resource="worker r0-w0-abc", worker="flow-run-0", rank=0,
                                                   status="idle")]
    cloud = [_row(resource="worker r1 on abcdef123456", status="failed", kind="failed_attempt", stop=5.2),
             _row(resource="worker r0 on 0123456789ab", worker="flow-run-0", rank=0, status="running")]
    rows = replace_measured(coordinator, cloud)
    assert [(r.resource, r.status, r.kind) for r in rows] == [
        ("worker r1 on abcdef123456", "preempted", "worker"), ("worker r0 on 0123456789ab", "running", "worker")]
    again = replace_measured(rows, cloud)  # the next epoch's reading keeps the mark
    assert [(r.resource, r.status) for r in again] == [(r.resource, r.status) for r in rows]

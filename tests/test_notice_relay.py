"""`runtime.notice_relay`: a spot container's notice that comes while the worker starts is kept
until the worker can take it, then passed on with the time it came; every other signal passes on
at once; the relay exits with its child's status. Real processes and real signals; each step
waits for an event the child writes (a file), never a sleep."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.notice import NOTICE_DIR_VAR, READY, ready_for_notice, take_relayed_notice
from tests.source_tree import ROOT

CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from core.notice import ready_for_notice, take_relayed_notice
    out, go = Path(sys.argv[1]), Path(sys.argv[2])
    got = []
    def on_term(signum, frame):
        noticed_at = take_relayed_notice() or time.time()
        got.append({"noticed_at": noticed_at, "at": time.time()})
    (out / "started").write_text(json.dumps({"pid": os.getpid(), "dir": os.environ.get("ZOOID_NOTICE_DIR")}))
    while not go.exists():  # starting: no handler of its own (the default ends it)
        time.sleep(0.01)
    signal.signal(signal.SIGTERM, on_term)
    ready_for_notice()
    while not got:  # serving: the notice comes once it is ready
        time.sleep(0.01)
    (out / "noticed").write_text(json.dumps(got[0]))
    sys.exit(7)
""")


def _until(path: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    """The JSON the child writes to `path` (the event), once it exists."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the relay ended ({proc.returncode}) before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout_s:.0f} s"
        time.sleep(0.01)
    return json.loads(path.read_text())


def _relay(tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen([sys.executable, "-m", "runtime.notice_relay", sys.executable, str(script),
                             str(tmp_path), str(tmp_path / "go")], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_notice_while_the_worker_starts_is_kept_until_it_is_ready_then_passed_on_with_its_time(tmp_path):
    proc = _relay(tmp_path)
    try:
        started = _until(tmp_path / "started", proc)
        assert started["dir"] and Path(started["dir"]).is_dir()  # the relay's directory, for its child only
        before = time.time()
        proc.send_signal(signal.SIGTERM)  # the provider's notice, while the worker has no handler
        deadline = time.monotonic() + 30
        while not (Path(started["dir"]) / "noticed_at").exists():  # the relay kept it (an event)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        kept_at = float((Path(started["dir"]) / "noticed_at").read_text())
        assert before <= kept_at <= time.time()
        (tmp_path / "go").write_text("")  # the worker gets its handler and says it is ready
        noticed = _until(tmp_path / "noticed", proc)
        assert noticed["noticed_at"] == kept_at < noticed["at"]  # delivered late, dated when it came
        assert proc.wait(30) == 7  # the child's own status
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not Path(started["dir"]).exists()  # the relay cleans up after itself


def test_once_the_worker_is_ready_a_notice_passes_at_once_dated_when_it_came(tmp_path):
    proc = _relay(tmp_path)
    try:
        _until(tmp_path / "started", proc)
        (tmp_path / "go").write_text("")
        ready = Path(_until(tmp_path / "started", proc)["dir"]) / READY
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before = time.time()
        proc.send_signal(signal.SIGTERM)
        noticed = _until(tmp_path / "noticed", proc)
        assert before <= noticed["noticed_at"] <= noticed["at"]  # none kept: its own time
        assert proc.wait(30) == 7
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_notice_before_the_worker_is_ready_passes_on_and_the_relay_exits_128_plus_it(tmp_path):
    proc = _relay(tmp_path)
    try:
        started = _until(tmp_path / "started", proc)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not (Path(started["dir"]) / "noticed_at").exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)  # leave now: the starting child's default ends it
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert not (tmp_path / "noticed").exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_without_a_relay_the_worker_side_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv(NOTICE_DIR_VAR, raising=False)
    ready_for_notice()
    assert take_relayed_notice() is None
    monkeypatch.setenv(NOTICE_DIR_VAR, str(tmp_path))
    (tmp_path / "noticed_at").write_text(repr(time.time() - 3))
    at = take_relayed_notice()
    assert at is not None and time.time() - at >= 3
    assert take_relayed_notice() is None  # taken once: a later notice comes as it comes
    ready_for_notice()
    assert (tmp_path / READY).exists()


@pytest.mark.parametrize("capacity,relayed", [("spot", True), ("on_demand", False)])
def test_only_spot_containers_run_under_the_relay(capacity, relayed):
    from clouds.provider import FLOW_RUN_COMMAND, SPOT_FLOW_RUN_COMMAND, WorkerResources
    from clouds.registry import job_variables

    command = job_variables("docker", WorkerResources(vcpu=1, memory_gb=1), "zrelay", capacity=capacity)["command"]
    assert command == (SPOT_FLOW_RUN_COMMAND if relayed else FLOW_RUN_COMMAND)
    assert command.endswith(FLOW_RUN_COMMAND)

"""Inline workers forked ready-imported (`coordinator.workers.worker_forks`, `runtime.fork_server`):
a forked worker answers as a started process would (exit status, output, a signal's death),
trains in the environment it was given, carries the run's tag in a session of its own; the fork
server outlives its workers, serves the run's next ones from the same imports, and leaves when
it is closed (the run's teardown) or, having died, is started afresh."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.workers.sweep import COORDINATOR_VAR, TAG_VAR, stop_pids, tagged_pids, worker_pids
from coordinator.workers.worker_forks import WorkerForks
from comm.store_dir import DirectoryStore
from core.keys import command_key, reply_key, status_key
from core.specs import ComputeSpec, WarmSpec, WorkerSpec
from engine import preemption
from runtime.warm import read_json
from tests.test_warm_workers import _await_reply, _publish_run

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def _forks(run_id: str, tmp_path: Path) -> WorkerForks:
    return WorkerForks({**os.environ, TAG_VAR: run_id, COORDINATOR_VAR: str(os.getpid())}, tmp_path / "forks.out")


def _environ(pid: int) -> dict[bytes, bytes]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def test_a_forked_worker_exits_and_writes_as_a_started_process_does(tmp_path):
    argv = ["--spec-json", json.dumps({"run_id": "zforks-a", "epoch": 0})]  # refused: no store
    with open(tmp_path / "started.log", "wb") as out:
        started = subprocess.run([sys.executable, "-m", "runtime.worker_main", *argv], cwd=ROOT, stdout=out,
                                 stderr=subprocess.STDOUT).returncode
    forks = _forks("zforks-a", tmp_path)
    forked = forks.start(argv, dict(os.environ), tmp_path / "forked.log")
    try:
        assert forked is not None and forked.wait(timeout=120) == started == 2
    finally:
        forks.close()
    assert (tmp_path / "forked.log").read_text() == (tmp_path / "started.log").read_text()
    assert "ZooidValueError" in (tmp_path / "forked.log").read_text()


def test_a_forked_warm_worker_trains_tagged_in_its_own_session_and_the_server_stays_until_closed(dir_store,
                                                                                                  tmp_path):
    from coordinator.workers.warm_pool import LeaseRenewer

    run_id = "zforks-b"
    _publish_run(dir_store, run_id)
    renewer = LeaseRenewer(lambda: type(dir_store)(dir_store.root), run_id, 0.2)
    renewer.start()
    forks = _forks(run_id, tmp_path)
    beat = tmp_path / "w.heartbeat"
    warm = WorkerSpec(run_id=run_id, epoch=0, rank=0, world=1, store_url=dir_store.url, model="digits_mlp",
                      dataset="digits", steps=0, batch_size=16, lr=0.05,
                      warm=WarmSpec(worker="r0-w0", lease_s=30.0, check_s=0.2))
    proc = forks.start(["--spec-json", json.dumps(warm.to_dict())],
                       {**os.environ, "ZOOID_HEARTBEAT": str(beat), "OMP_NUM_THREADS": "1"}, tmp_path / "w.log")
    try:
        assert proc is not None
        server = forks.server.pid
        # the run's tag, read as the sweep reads it, in a session of the worker's own
        assert _environ(proc.pid)[TAG_VAR.encode()] == run_id.encode()
        assert os.getsid(proc.pid) == proc.pid != server
        assert tagged_pids(run_id) == sorted([server, proc.pid]) and worker_pids(run_id) == [proc.pid]

        spec = WorkerSpec(run_id=run_id, epoch=0, rank=0, world=1, store_url=dir_store.url, model="digits_mlp",
                          dataset="digits", steps=5,
                          batch_size=16, lr=0.05, optimizer="sgd", init_key=f"runs/{run_id}/ckpt/init.safetensors",
                          out_key=f"runs/{run_id}/ckpt/epoch-0.safetensors", compute=ComputeSpec(threads=1))
        dir_store.put(command_key(run_id, "r0-w0", 0), json.dumps({"op": "epoch", "spec": spec.to_dict()}).encode())
        reply = _await_reply(dir_store, run_id, "r0-w0", 0, proc)
        assert reply["ok"] and reply["result"]["pid"] == proc.pid and reply["result"]["samples"] == 80
        assert beat.exists()  # its environment is the one it was started with, not the server's

        dir_store.put(command_key(run_id, "r0-w0", 1), json.dumps({"op": "stop", "reason": "test"}).encode())
        assert proc.wait(timeout=60) == 0
        assert read_json(dir_store, reply_key(run_id, "r0-w0", 1))["stopped"]
        assert tagged_pids(run_id) == [server]  # its last worker gone, the fork server waits for the next
        forks.close()
        assert tagged_pids(run_id) == [] and forks.server is None
        forks.close()  # twice: nothing to do
    finally:
        renewer.stop()
        stop_pids(tagged_pids(run_id))


def test_a_killed_forked_worker_reads_minus_the_signal_and_the_next_comes_from_the_same_server(tmp_path):
    forks = _forks("zforks-c", tmp_path)
    spec = WorkerSpec(run_id="zforks-c", epoch=0, rank=0, world=1, store_url=f"file://{tmp_path}/store",
                      model="digits_mlp", dataset="digits", steps=0, batch_size=16, lr=0.05,
                      warm=WarmSpec(worker="r0-w0", lease_s=30.0, check_s=0.2))
    argv = ["--spec-json", json.dumps(spec.to_dict())]
    first = forks.start(argv, dict(os.environ), tmp_path / "a.log")
    server = forks.server.pid
    try:
        os.killpg(first.pid, signal.SIGKILL)
        assert first.wait(timeout=60) == -signal.SIGKILL and first.poll() == -signal.SIGKILL
        store = DirectoryStore(tmp_path / "store")
        store.delete(status_key("zforks-c", "r0-w0"))  # whatever the killed one wrote
        second = forks.start(argv, dict(os.environ), tmp_path / "b.log")
        assert second is not None and forks.server.pid == server  # no second import
        store.get(status_key("zforks-c", "r0-w0"), timeout=60)  # it serves: its SIGTERM handler is in place
        stop_pids([second.pid], grace_s=5.0)
        # a SIGTERM outside an epoch is a notice to leave: at once, with the preempted status
        assert second.wait(timeout=60) == preemption.EXIT_STATUS
        # a fork server that died is started afresh by the next start
        os.killpg(server, signal.SIGKILL)
        forks.server.wait()
        store.delete(status_key("zforks-c", "r0-w0"))
        third = forks.start(argv, dict(os.environ), tmp_path / "c.log")
        assert third is not None and forks.server.pid != server
        store.get(status_key("zforks-c", "r0-w0"), timeout=60)
        stop_pids([third.pid], grace_s=5.0)
        assert third.wait(timeout=60) == preemption.EXIT_STATUS
    finally:
        forks.close()
        stop_pids(tagged_pids("zforks-c"))

"""Warm workers: one worker per rank lives across epochs, commanded through the store.

Engine-level tests run a real warm worker process (`python -m runtime.worker_main`) on a
directory store; flow-level tests run the `train` flow against a real Prefect API with the
inline target. Waits are for events (a reply, a process exit), bounded only as a safety net.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coordinator.run.job import TrainJob
from core.errors import ZooidValueError
from core.specs import ComputeSpec, WarmSpec, WorkerSpec
from runtime.warm import LEASE_EXIT, LeaseClock, command_key, read_json, reply_key, status_key
from tests.forked_workers import start_worker

ROOT = Path(__file__).resolve().parent.parent


# --- the lease, pure ---------------------------------------------------------------------


def test_lease_ages_from_its_last_change_on_the_readers_clock():
    now = [100.0]
    lease = LeaseClock(5.0, clock=lambda: now[0])
    now[0] = 104.0
    assert not lease.expired  # never seen: as old as the reader
    now[0] = 105.5
    assert lease.expired
    lease.observe(b'{"seq": 1}')
    assert lease.age_s == 0 and not lease.expired
    now[0] = 109.0
    lease.observe(b'{"seq": 1}')  # the same value again is no renewal
    assert lease.age_s == pytest.approx(3.5)
    now[0] = 111.0
    assert lease.expired
    lease.observe(b'{"seq": 2}')
    assert not lease.expired
    lease.observe(None)  # a missing key does not renew
    now[0] = 116.5
    assert lease.expired


@pytest.mark.parametrize("raw, field", [("r0-w0", "warm"), ({"lease_s": 3}, "warm.worker"),
                                        ({"worker": "r0-w0", "lease_s": 0}, "warm.lease_s"),
                                        ({"worker": "r0-w0", "check_s": True}, "warm.check_s")])
def test_warm_settings_refuse_bad_values(raw, field):
    spec = WorkerSpec(run_id="r", epoch=0, rank=0, world=1, store_url="file:///x", model="digits_mlp",
                      dataset="digits", steps=0, batch_size=16, lr=0.05)
    with pytest.raises(ZooidValueError, match=f"^{field}:"):
        WorkerSpec.from_dict({**spec.to_dict(), "warm": raw})


# --- one warm worker process, no Prefect ---------------------------------------------------


def _publish_run(store, run_id: str) -> dict:
    from engine.checkpoint import initial_checkpoint
    from engine.datasets import publish_dataset

    manifest = publish_dataset(store, run_id, "synthetic:64:10:80:20", 16)  # an epoch: 5 steps of 16
    initial_checkpoint(store, f"runs/{run_id}/ckpt/init.safetensors", "digits_mlp", "sgd", 0.05, seed=0,
                       meta={"run_id": run_id})
    return manifest.to_dict()


def _launch(store_url: str, run_id: str, worker: str, log: Path, lease_s: float = 30.0, notice_s: float = 0.0):
    spec = WorkerSpec(run_id=run_id, epoch=0, rank=0, world=1, store_url=store_url, model="digits_mlp",
                      dataset="digits", steps=0, batch_size=16, lr=0.05,
                      warm=WarmSpec(worker=worker, lease_s=lease_s, check_s=0.2, notice_s=notice_s))
    return start_worker(spec, dict(os.environ), log)


def _epoch_command(channel, data, run_id: str, worker: str, seq: int, epoch: int) -> WorkerSpec:
    """Send warm worker `worker` its `seq`-th command through `channel`: epoch `epoch` of a lone
    replica on the `data` store (`_publish_run`'s), from the epoch before's checkpoint (the
    run's init for epoch 0). Returns the spec sent."""
    init = f"runs/{run_id}/ckpt/" + (f"epoch-{epoch - 1}.safetensors" if epoch else "init.safetensors")
    spec = WorkerSpec(run_id=run_id, epoch=epoch, rank=0, world=1, store_url=data.url, model="digits_mlp",
                      dataset="digits", steps=5, batch_size=16, lr=0.05, optimizer="sgd", init_key=init,
                      out_key=f"runs/{run_id}/ckpt/epoch-{epoch}.safetensors", compute=ComputeSpec(threads=1))
    channel.put(command_key(run_id, worker, seq), json.dumps({"op": "epoch", "spec": spec.to_dict()}).encode())
    return spec


def _await_reply(store, run_id, worker, seq, proc) -> dict:
    """The worker's reply to command `seq`, once it appears (a hang is the test's timeout)."""
    while True:
        reply = read_json(store, reply_key(run_id, worker, seq))
        if reply is not None:
            return reply
        assert proc.poll() is None, f"worker exited with {proc.returncode}"
        time.sleep(0.02)


@pytest.mark.timeout(300)
def test_a_warm_worker_trains_epoch_after_epoch_in_one_process_then_stops(dir_store, tmp_path):
    from coordinator.workers.warm_pool import LeaseRenewer

    run_id = "warmengine"
    _publish_run(dir_store, run_id)
    renewer = LeaseRenewer(lambda: type(dir_store)(dir_store.root), run_id, 0.2)
    renewer.start()
    proc = _launch(dir_store.url, run_id, "r0-w0", tmp_path / "w.log")
    try:
        pids, init = [], f"runs/{run_id}/ckpt/init.safetensors"
        for epoch in range(3):
            spec = WorkerSpec(run_id=run_id, epoch=epoch, rank=0, world=1, store_url=dir_store.url,
                              model="digits_mlp", dataset="digits",
                              steps=5,
                              batch_size=16, lr=0.05, optimizer="sgd", init_key=init,
                              out_key=f"runs/{run_id}/ckpt/epoch-{epoch}.safetensors",
                              compute=ComputeSpec(threads=1))
            dir_store.put(command_key(run_id, "r0-w0", epoch), json.dumps({"op": "epoch", "spec": spec.to_dict()}).encode())
            reply = _await_reply(dir_store, run_id, "r0-w0", epoch, proc)
            assert reply["ok"] and reply["result"]["epoch"] == epoch and reply["result"]["samples"] == 80
            assert reply["ready_at"] <= reply["began_at"] <= reply["ended_at"]
            pids.append(reply["result"]["pid"])
            init = spec.out_key
        assert pids == [proc.pid] * 3
        status = read_json(dir_store, status_key(run_id, "r0-w0"))
        assert status["pid"] == proc.pid
        dir_store.put(command_key(run_id, "r0-w0", 3), json.dumps({"op": "stop", "reason": "test"}).encode())
        assert proc.wait(timeout=60) == 0
        assert read_json(dir_store, reply_key(run_id, "r0-w0", 3))["stopped"]
    finally:
        renewer.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_warm_worker_whose_lease_is_not_renewed_stops_itself(dir_store, tmp_path):
    run_id = "warmnolease"
    log = tmp_path / "w.log"
    proc = _launch(dir_store.url, run_id, "r0-w0", log, lease_s=1.0)
    try:
        assert proc.wait(timeout=120) == LEASE_EXIT
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "lease was not renewed" in text and "worker_lease_s=1" in text


# --- the train flow with warm workers ------------------------------------------------------


def _lives(rows: list[dict]) -> dict[str, list[dict]]:
    by_worker: dict[str, list[dict]] = {}
    for r in rows:
        if r["kind"] in ("worker", "failed_attempt"):
            by_worker.setdefault(r["worker"], []).append(r)
    return {w: sorted(rs, key=lambda r: r["start"]) for w, rs in by_worker.items()}


@pytest.mark.usefixtures("prefect_api")
def test_warm_run_keeps_one_process_per_rank_and_bills_its_whole_life(tmp_path):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from coordinator.workers.sweep import tagged_pids
    from flows.train import train

    store_url = f"file://{tmp_path}/store"
    summary = train(TrainJob(workers=2, epochs=3, store=store_url, batch_size=32, target="inline",
                             keep_checkpoints=2, sync_period=5))
    assert summary.status == "completed"
    pids = [e.worker_pids for e in summary.epochs]
    assert len(set(pids[0].values())) == 2 and pids[0] == pids[1] == pids[2]
    store = open_store(store_url)
    ledger = read_ledger(store, summary.run_id)
    lives = _lives(ledger["rows"])
    assert len(lives) == 2
    for rows in lives.values():
        # start-up, then idle/busy alternating, back to back: the rows are the worker's life
        # (rank 0 also took the profile)
        assert rows[0]["status"] == "startup"
        assert sum(r["status"] == "busy" for r in rows) == 3
        for before, after in zip(rows, rows[1:]):
            assert after["start"] == pytest.approx(before["stop"], abs=1e-6)
        assert sum(r["seconds"] for r in rows) == pytest.approx(rows[-1]["stop"] - rows[0]["start"], abs=1e-3)
        assert all(r["status"] in ("startup", "busy", "idle", "profile") for r in rows)
    assert sum(r["status"] == "profile" for r in ledger["rows"]) == 2  # the model, then the store
    assert tagged_pids(summary.run_id) == []
    assert store.list(f"runs/{summary.run_id}/warm/") == []
    # the last two epoch checkpoints stay; the finished epochs' sync checkpoints are gone
    assert [k.rsplit("/", 1)[1] for k in store.list(f"runs/{summary.run_id}/ckpt/")] == [
        "epoch-0001.safetensors", "epoch-0002.safetensors", "init.safetensors"]
    assert summary.worker_seconds["busy"] > 0 and summary.worker_seconds["startup"] > 0


def test_pruning_keeps_the_last_checkpoints_and_the_best(dir_store):
    from coordinator.workers.retention import prune_checkpoints, update_best

    run = "prune"
    for epoch in range(6):
        dir_store.put(f"runs/{run}/ckpt/epoch-{epoch:04d}.safetensors", b"x")
        dir_store.put(f"runs/{run}/ckpt/sync-e{epoch}.safetensors", b"x")
    best = None
    for epoch, loss in enumerate([0.9, 0.5, 0.2, 0.4, 0.3, 0.35]):
        best = update_best(dir_store, run, epoch, f"runs/{run}/ckpt/epoch-{epoch:04d}.safetensors", loss)
    assert best["epoch"] == 2
    deleted = prune_checkpoints(dir_store, run, latest_epoch=4, keep=2, best=best)
    left = [k.rsplit("/", 1)[1] for k in dir_store.list(f"runs/{run}/ckpt/")]
    # epoch 5 is not finished (latest is 4): its checkpoint and its sync checkpoint stay
    assert left == ["best.json", "epoch-0002.safetensors", "epoch-0003.safetensors", "epoch-0004.safetensors",
                    "epoch-0005.safetensors", "sync-e5.safetensors"]
    assert len(deleted) == 7


def test_progress_moves_within_an_epoch_by_the_steps_workers_report(monkeypatch):
    from types import SimpleNamespace

    import flows.train

    moved = []
    monkeypatch.setattr(flows.train, "update_progress_artifact", lambda pid, value: moved.append((pid, value)))
    steps = [(0, 40)]
    ctx = SimpleNamespace(job=TrainJob(epochs=4), state=SimpleNamespace(warm=SimpleNamespace(progress=lambda: steps[-1])))
    tick = flows.train.epoch_progress_tick(ctx, "artifact-id", done=1, every_s=0.0)
    steps.append((20, 40))
    tick()
    steps.append((40, 40))
    tick()
    assert moved == [("artifact-id", 37.5), ("artifact-id", 50.0)]


def _final_weights(store_url: str, summary) -> dict[str, torch.Tensor]:
    from comm.store import open_store
    from comm.tensor_codec import decode_tensors

    store = open_store(store_url)
    tensors, _ = decode_tensors(store.get(summary.checkpoint_key))
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_rescaling_warm_workers_up_and_down_trains_as_the_cold_path(tmp_path, monkeypatch):
    """Workers 2 -> 3 -> 1 -> 2 under plain SGD: warm and cold end with the same weights; the
    warm run kept rank 0's process, retired ranks the plan dropped and started new ones."""
    import coordinator.plan.scaling_policy
    from core.epoch_summary import Rescale
    from flows.train import train

    script = {0: 3, 1: 1, 2: 2}
    monkeypatch.setattr(coordinator.plan.scaling_policy, "decide_next", lambda ctx, prof, history, workers, lr: Rescale(
        workers=script[history[-1].epoch], lr=lr, reason="scripted"))
    weights, runs = [], []
    for warm in (True, False):
        store_url = f"file://{tmp_path}/{warm}"
        summary = train(TrainJob(workers=2, epochs=4, max_workers=4, store=store_url, batch_size=32,
                                 optimizer="sgd", strategy="local_sgd", warm=warm, prestart=False,
                                 target="inline"))
        assert summary.status == "completed"
        assert [e.workers for e in summary.epochs] == [2, 3, 1, 2]
        weights.append(_final_weights(store_url, summary))
        runs.append(summary)
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-5, atol=1e-6)
    pids = [e.worker_pids for e in runs[0].epochs]
    assert pids[0]["0"] == pids[1]["0"] == pids[2]["0"] == pids[3]["0"]  # rank 0 stayed warm
    assert pids[1]["1"] == pids[0]["1"] and "2" in pids[1] and "2" not in pids[2]
    assert pids[3]["1"] != pids[0]["1"]  # rank 1 retired at 1 worker, started again at 2


@pytest.mark.usefixtures("prefect_api")
def test_a_warm_worker_killed_mid_epoch_is_replaced_and_the_epoch_completes(tmp_path, monkeypatch):
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from coordinator.workers.sweep import tagged_pids
    from flows.train import train

    monkeypatch.setenv("ZOOID_CHAOS", "kill_worker:epoch=1:rank=1:step=3")
    store_url = f"file://{tmp_path}/store"
    summary = train(TrainJob(workers=2, epochs=3, store=store_url, batch_size=32, strategy="local_sgd",
                             target="inline"))
    assert summary.status == "completed" and len(summary.epochs) == 3
    failed = summary.epochs[1].relaunches
    assert [(f["rank"], f["failure"]["kind"]) for f in failed] == [(1, "injected")]
    pids = [e.worker_pids for e in summary.epochs]
    assert pids[0]["0"] == pids[1]["0"] == pids[2]["0"]
    assert pids[0]["1"] != pids[1]["1"] == pids[2]["1"]  # the replacement stays warm
    ledger = read_ledger(open_store(store_url), summary.run_id)
    lost = [r for r in ledger["rows"] if r["kind"] == "failed_attempt"]
    assert len(lost) == 1 and lost[0]["epoch"] == 1 and lost[0]["rank"] == 1
    assert lost[0]["status"].startswith("crashed")
    assert len(_lives(ledger["rows"])) == 3  # two warm workers and the one that replaced the killed one
    assert tagged_pids(summary.run_id) == []


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_workers_of_a_killed_coordinator_exit_within_their_lease(tmp_path):
    """SIGKILL the whole coordinator (its process group: the flow and its temporary Prefect
    server) mid-run: its warm workers, in sessions of their own, stop once the lease is stale."""
    from coordinator.workers.sweep import tagged_pids, worker_pids

    home = tmp_path / "zooid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "flows.train", "--param", "workers=2", "--param", "epochs=500",
         "--param", "worker_lease_s=5", "--param", "batch_size=32"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        runs = home / "store" / "runs"
        replies = []
        while not replies:  # the event: a warm worker finished an epoch
            replies = _epoch_replies(runs)
            assert coordinator.poll() is None, "the coordinator ended early"
            time.sleep(0.2)
        run_id = replies[0].relative_to(runs).parts[0]
        workers = worker_pids(run_id)
        assert len(workers) == 2
        guards = _children_running(coordinator.pid, "deployments.orphan_guard")
        assert len(guards) == 1  # the temporary Prefect server's guard
    finally:
        os.killpg(coordinator.pid, signal.SIGKILL)
        coordinator.wait()
    while tagged_pids(run_id) or any(_alive(p) for p in guards):  # until they are gone (or the test times out)
        time.sleep(0.2)
    assert tagged_pids(run_id) == []
    assert not any(_alive(p) for p in guards)  # nor does its temporary Prefect server outlive it
    logs = {p.name: p.read_text() for p in (home / "logs" / run_id).glob("*.log")}
    assert len(logs) == 2, sorted(logs)
    quiet = {name: text[-1500:] for name, text in logs.items() if "lease was not renewed" not in text}
    assert not quiet, quiet


@pytest.mark.usefixtures("prefect_api")
def test_workers_a_known_rescale_adds_are_started_during_the_epoch_before(tmp_path, monkeypatch):
    """adabatch doubles 1 -> 2 workers after epoch 0, which is known before epoch 0 ends: the
    second worker is launched while epoch 0 trains, and epoch 1 starts on it warm."""
    import coordinator.workers.launchers
    from comm.store import open_store
    from coordinator.bill.cost import read_ledger
    from flows.train import train

    launched, real_start = [], coordinator.workers.launchers.InlineLauncher._start

    def record(self, spec):  # every worker process started, in order: (rank, pid)
        proc, outcome = real_start(self, spec)
        launched.append((spec.rank, proc.pid))
        return proc, outcome

    monkeypatch.setattr(coordinator.workers.launchers.InlineLauncher, "_start", record)
    store_url = f"file://{tmp_path}/store"
    # epoch 0's worker holds before its step 5 until a warm worker of rank 1 exists, however
    # loaded the machine: the pre-start is ordered by that event, not by the epoch's length
    monkeypatch.setenv("ZOOID_CHAOS", "hold_worker:epoch=0:rank=0:step=5:until=warm/r1-")
    summary = train(TrainJob(workers=1, max_workers=2, epochs=2, scaling="adabatch", scale_every_epochs=1,
                             dataset="synthetic:64:10:8000", store=store_url, batch_size=32, target="inline"))
    assert [e.workers for e in summary.epochs] == [1, 2]
    rows = read_ledger(open_store(store_url), summary.run_id)["rows"]
    lives = _lives(rows)
    first_busy = next(r for r in rows if r["status"] == "busy" and r["epoch"] == 0)
    second = next(rs for rs in lives.values() if rs[0]["rank"] == 1)
    assert second[0]["status"] == "startup" and second[0]["start"] < first_busy["stop"]
    # epoch 1 runs on the two processes already up: rank 0's of epoch 0 and the one rank-1
    # process ever started (the pre-started one), each warm, no process started after
    [rank1] = [pid for rank, pid in launched if rank == 1]
    pids0, pids1 = summary.epochs[0].worker_pids, summary.epochs[1].worker_pids
    assert {k: int(v) for k, v in pids1.items()} == {"0": int(pids0["0"]), "1": rank1}
    assert launched[-1] == (1, rank1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_the_command_line_tears_down_and_bills_before_exiting(tmp_path):
    """`python -m flows.train` without a Prefect API: its temporary server runs in a session of
    its own, so a SIGTERM to the run's process group still finds the API for teardown and the
    bill; then the server is stopped too."""
    import socket

    from coordinator.workers.sweep import tagged_pids

    home = tmp_path / "zooid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    coordinator = subprocess.Popen([sys.executable, "-m", "flows.train", "--param", "workers=2",
                                    "--param", "epochs=500", "--param", "batch_size=32"],
                                   cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)
    runs = home / "store" / "runs"
    try:
        replies = []
        while not replies:  # the event: a warm worker finished an epoch
            replies = _epoch_replies(runs)
            assert coordinator.poll() is None, coordinator.stderr.read()[-2000:]
            time.sleep(0.2)
        os.killpg(coordinator.pid, signal.SIGTERM)
        coordinator.wait(timeout=300)
    finally:
        if coordinator.poll() is None:
            os.killpg(coordinator.pid, signal.SIGKILL)
            coordinator.wait()
    run = replies[0].relative_to(runs).parts[0]
    assert coordinator.returncode != 0
    assert tagged_pids(run) == []
    ledger = json.loads((runs / run / "cost.json").read_text())
    assert any(r["kind"] == "coordinator" for r in ledger["rows"])
    assert not any(r["status"] == "open" for r in ledger["rows"])  # every worker billed to its stop
    assert json.loads((runs / run / "summary.json").read_text())["status"] == "cancelled"
    assert not (runs / run / "warm").exists() or not any((runs / run / "warm").rglob("*.json"))
    [log] = (home / "logs").glob("server-*.log")
    port = int(log.stem.split("-")[1])
    with socket.socket() as s:  # the temporary server is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0


def _epoch_replies(runs) -> list:
    """Warm workers' replies to an epoch command (not to a profile command)."""
    if not runs.exists():
        return []
    return [r for r in runs.glob("*/warm/*/reply-*.json") if b'"result"' in r.read_bytes()]


def _children_running(parent: int, marker: str) -> list[int]:
    """Pids of `parent`'s children whose command line holds `marker`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and marker in cmd:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.timeout(300)
def test_a_channel_on_redis_emptied_by_a_restart_gets_its_reply_and_command_again(dir_store, tmp_path, redis_server):
    """The warm channel on the run's Redis (`RunContext.channel_ref`): a restart without
    persistence empties it. The idle worker puts its last reply back (the coordinator may still
    wait for it) and the pool puts a command in flight back, so neither side waits for a stall
    timeout."""
    from comm.store_redis import RedisStore
    from coordinator.workers.launchers import WorkerOutcome
    from coordinator.workers.warm_pool import Command, LeaseRenewer, WarmPool, WarmWorker

    run_id = "warmredis"
    _publish_run(dir_store, run_id)
    channel = RedisStore(redis_server.url)
    renewer = LeaseRenewer(lambda: RedisStore(redis_server.url), run_id, 0.2)
    renewer.start()
    proc = _launch(redis_server.url, run_id, "r0-w0", tmp_path / "w.log", lease_s=600)
    try:
        spec = _epoch_command(channel, dir_store, run_id, "r0-w0", 0, 0)
        reply = _await_reply(channel, run_id, "r0-w0", 0, proc)
        assert reply["ok"] and dir_store.exists(f"runs/{run_id}/ckpt/epoch-0.safetensors")  # data stays durable
        redis_server.restart()
        assert read_json(channel, reply_key(run_id, "r0-w0", 0)) is None  # gone with the restart
        assert _await_reply(channel, run_id, "r0-w0", 0, proc) == reply  # put back by the idle worker
    finally:
        renewer.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the pool's side: a command in flight that the store lost is put back at the next status read
    pool = WarmPool(SimpleNamespace(run_id=run_id))
    pool.store = channel
    w = WarmWorker(rank=0, name="r0-w1", launcher=None, identity="x", launched_at=time.time())
    w.command = Command(seq=3, spec=spec, outcome=WorkerOutcome(rank=0, attempt=0, started_at=time.time()))
    pool._repost(w)
    assert json.loads(channel.get(command_key(run_id, "r0-w1", 3)))["spec"] == spec.to_dict()
    channel.close()

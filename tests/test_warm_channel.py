"""The warm channel's requests (`runtime.warm`, `coordinator.workers.warm_pool`): each is a billed
request on a cloud store, so they are paced by what they are for. A control-plane wait reads at
the store's pace, then at most 2 % of its wait apart (`control_pause`); a worker writes its status
when it starts and then at most every `progress_s` while it changed; the coordinator reads one
worker's reply a tick, and the others' once one has answered. Counted in requests, never timed."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from comm.store import open_store
from core.polling import CONTROL_POLL_SHARE, POLL_GROWTH, control_pause, control_reads
from core.keys import reply_key, status_key
from core.specs import WarmSpec, WorkerResult, WorkerSpec


def test_a_control_wait_follows_the_store_then_grows_with_the_wait():
    assert control_pause(0.002, 0.0, 0.1, 1.0) == pytest.approx(0.002 * POLL_GROWTH)
    assert control_pause(0.09, 1.0, 0.1, 1.0) == pytest.approx(0.1)  # the store's own cap, 2 % of 1 s below it
    assert control_pause(0.1, 20.0, 0.1, 1.0) == pytest.approx(20.0 * CONTROL_POLL_SHARE)
    assert control_pause(0.4, 500.0, 0.1, 1.0) == 1.0  # the cap
    assert control_pause(0.001, 500.0, 0.1, 0.01) == 0.1  # a cap below the store's poll: the store's
    assert control_pause(0.05, 0.0, 0.002, 1.0) == 0.05  # begun slower than the store polls: never faster


def test_a_long_wait_on_s3_costs_a_twentieth_of_the_reads_of_polling_at_its_pace():
    # S3's pace: 0.1 s. A warm worker idle for 10 minutes read 6,000 times at it; now 301
    # (50 in the first 5 s, then about ln(600 / 5) / 0.02)
    reads = control_reads(600.0, 0.002, 0.1, 10.0)
    assert reads < (600.0 / 0.1) / 19
    # and a short wait (an epoch's 4 s) is read at the store's pace: seen as soon as before
    assert control_reads(4.0, 0.002, 0.1, 1.0) == control_reads(4.0, 0.002, 0.1, 0.1)


class _Counting:
    """A directory store that counts puts by key."""

    def __init__(self, url: str):
        self.inner = open_store(url)
        self.puts: list[str] = []

    def put(self, key, data, **kw):
        self.puts.append(key)
        return self.inner.put(key, data, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_worker_writes_its_status_at_start_then_only_when_progress_is_due(tmp_path, monkeypatch):
    from comm import heartbeat
    from runtime.warm import _Watch

    store = _Counting(f"file://{tmp_path}/store")
    key = status_key("zrun", "r0-w0")
    slow = _Watch(lambda: store, "zrun", WarmSpec(worker="r0-w0", progress_s=3600.0), time.time(), print)
    slow.doc.update(state="idle")
    slow.publish(store)  # the start's, at once
    assert store.puts == [key] and json.loads(store.get(key))["state"] == "idle"
    slow.busy(0, 0, time.time())
    monkeypatch.setattr(heartbeat, "progress", lambda: (7, 123.0))
    for _ in range(50):  # the watch's wakes within an hour: nothing due
        slow.publish_due(store)
    assert store.puts == [key]

    fast = _Watch(lambda: store, "zrun", WarmSpec(worker="r0-w0", progress_s=1e-9), time.time(), print)
    fast.doc.update(state="busy", seq=0, epoch=0)
    fast.publish_due(store)
    assert len(store.puts) == 2 and json.loads(store.get(key))["steps"] == 7
    fast.publish_due(store)  # nothing changed since: nothing written
    assert len(store.puts) == 2
    monkeypatch.setattr(heartbeat, "progress", lambda: (8, 124.0))
    fast.publish_due(store)
    assert len(store.puts) == 3 and json.loads(store.get(key))["steps"] == 8


class _Launcher:
    def __init__(self):
        from coordinator.workers.launchers import WorkerOutcome

        self.outcomes = [WorkerOutcome(rank=0, attempt=0, started_at=time.time())]
        self.polls = 0

    def _poll(self):
        self.polls += 1


def _pool(tmp_path, workers: int, busy: bool = True):
    from coordinator.run.context import RunContext
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import validate_job
    from coordinator.workers.warm_pool import WarmPool, WarmWorker

    job = TrainJob(model="digits_mlp", workers=max(1, workers), store=f"file://{tmp_path}/store", warm=True)
    ctx = RunContext(run_id="zturn", job=job, resolved=validate_job(job))
    pool = WarmPool(ctx)
    pool.store = ctx.open_durable()
    for rank in range(workers if busy else 0):
        pool.workers[rank] = WarmWorker(rank=rank, name=f"r{rank}-w{rank}", launcher=_Launcher(), identity="x",
                                        launched_at=time.time(), billed_to=time.time(), ready_at=time.time())
        spec = WorkerSpec(run_id=ctx.run_id, epoch=0, rank=rank, world=workers, store_url=ctx.durable_ref,
                          model=job.model, dataset=job.dataset, subsets=(), steps=5, batch_size=16, lr=0.05)
        pool._send(pool.workers[rank], spec)
    return pool


def _reply(pool, rank: int) -> None:
    w = pool.workers[rank]
    now = time.time()
    result = WorkerResult(run_id=pool.ctx.run_id, epoch=0, rank=rank, started_at=now, stopped_at=now,
                          train_loss=1.0, samples=16)
    pool.store.put(reply_key(pool.ctx.run_id, w.name, w.command.seq),
                   json.dumps({"ok": True, "result": result.to_dict(), "began_at": now, "ended_at": now,
                               "ready_at": now}).encode())


def test_the_coordinator_reads_one_reply_a_tick_and_the_rest_once_one_answered(tmp_path):
    pool = _pool(tmp_path, 4)
    store = pool.store
    before = store.ops.miss + store.ops.get
    for tick in range(8):  # nobody has answered: one read a tick, each worker in turn
        pool._read_turn(tick, time.time(), 900.0, 0.0)
    assert store.ops.miss + store.ops.get - before == 8
    assert all(w.launcher.polls >= 6 for w in pool.workers.values())  # every worker is still watched
    for rank in range(4):
        _reply(pool, rank)
    before = store.ops.get
    pool._read_turn(8, time.time(), 900.0, 0.0)  # rank 0's turn: it answered, so the others are read at once
    assert store.ops.get - before == 4
    assert all(w.command is None for w in pool.workers.values())


def test_a_worker_that_died_is_read_at_once_whoever_s_turn_it_is(tmp_path):
    pool = _pool(tmp_path, 3)
    dead = pool.workers[2]
    dead.launcher.outcomes[0].status = "failed"
    w = dead
    spent = {"s3://bucket": {"put": 3, "get": 5, "miss": 40}}  # what the failed epoch asked of the store
    pool.store.put(reply_key(pool.ctx.run_id, w.name, w.command.seq),
                   json.dumps({"ok": False, "error": "RuntimeError", "message": "boom", "store_ops": spent}).encode())
    pool._read_turn(0, time.time(), 900.0, 0.0)  # rank 0's turn
    assert dead.command.outcome.error == "RuntimeError: boom"
    assert dead.command.outcome.status == "failed"
    billed = pool.ctx.state.store_ops["s3://bucket"]
    assert (billed.put, billed.get, billed.miss) == (3, 5, 40)
    pool._read_turn(1, time.time(), 900.0, 0.0)  # read again: billed once
    assert pool.ctx.state.store_ops["s3://bucket"].put == 3


def test_a_worker_found_dead_before_its_epoch_is_billed_as_what_it_died_of(tmp_path, monkeypatch):
    """A spot worker the provider took back while it started (SIGTERM before its handler: exit
    143) is found dead by the next `ensure`: its last row says `preempted`, and its rank alone
    gets a new worker; a live one is kept."""
    from coordinator.workers import warm_pool
    from coordinator.workers.warm_pool import WarmPool, WarmWorker

    pool = _pool(tmp_path, 2, busy=False)
    started = []
    monkeypatch.setattr(warm_pool, "make_launcher", lambda ctx, plan: None)
    monkeypatch.setattr(warm_pool, "launch_identity", lambda launcher, rank: "x")
    monkeypatch.setattr(WarmPool, "_open", lambda self: None)
    monkeypatch.setattr(WarmPool, "_start", lambda self, rank, *a, **k: started.append(rank))
    for rank in range(2):
        pool.workers[rank] = WarmWorker(rank=rank, name=f"r{rank}-w{rank}", launcher=_Launcher(), identity="x",
                                        launched_at=time.time() - 5, billed_to=time.time() - 5)
    dead = pool.workers[1].launcher.outcomes[0]
    dead.status, dead.stopped_at, dead.extra["exit_code"] = "failed", time.time(), 143
    pool.ensure(SimpleNamespace(workers=2), 3)
    assert started == [1] and 0 in pool.workers
    rows = [r for r in pool.ctx.state.ledger if r.rank == 1]
    assert [r.status for r in rows] == ["preempted"]


def test_an_epoch_that_raises_replies_the_requests_it_made(tmp_path):
    """`runtime.run_spec` hangs the failed epoch's requests on its exception; a warm worker's
    error reply carries them (`runtime.warm._failure`)."""
    from runtime.warm import _failure

    store = open_store(f"file://{tmp_path}/store")
    exc = RuntimeError("boom")
    exc.store_ops = {store.where: {"put": 2}}
    assert _failure(exc)["store_ops"] == {store.where: {"put": 2}}
    assert _failure(RuntimeError("no count"))["store_ops"] == {}  # nothing unreported in this process


def test_the_warm_channels_requests_of_an_epoch_follow_its_cadence():
    from core.store_ops import StoreOps
    from core.warm_cadence import WarmCadence
    from planners.store_requests import warm_channel_ops

    cadence = WarmCadence(lease_s=60.0, timeout_s=900.0)  # the defaults: lease read 7.5 s, progress 15 s
    assert (cadence.check_s, cadence.progress_s, cadence.status_every_s, cadence.renew_s) == (7.5, 15.0, 7.5, 15.0)
    # a 4 s epoch of 4 workers over S3 (0.1 s): 4 commands and 4 replies put, the 4 replies read,
    # 40 reads of the next reply before them (2 % of 4 s is under S3's own 0.1 s); nothing else due
    assert warm_channel_ops(4, 4.0, cadence, poll_first_s=0.1, poll_max_s=0.1) == StoreOps(put=8, get=4, miss=40)
    # a minute: 4 progress writes a worker and 4 renewals; 8 status and 8 lease reads a worker
    minute = warm_channel_ops(4, 60.0, cadence, poll_first_s=0.1, poll_max_s=0.1)
    assert (minute.put, minute.get) == (8 + 16 + 4, 4 + 32 + 32)
    assert minute.miss == control_reads(60.0, 0.1, 0.1, 1.0) < 60.0 / 0.1
    assert warm_channel_ops(0, 60.0, cadence, poll_first_s=0.1, poll_max_s=0.1) == StoreOps()


def test_the_watch_wakes_for_progress_when_it_is_due_before_the_lease(tmp_path, monkeypatch):
    """A stall timeout shorter than the lease's read period (`worker_timeout_s` 8 s against a
    7.5 s lease read) needs progress written more often than the lease is read: the watch wakes
    for whichever is due first."""
    import itertools
    import threading

    from comm import heartbeat
    from runtime.warm import _Watch

    store = _Counting(f"file://{tmp_path}/store")
    written = threading.Event()
    put = store.put

    def counted(key, data, **kw):
        put(key, data, **kw)
        if sum(k.endswith("status.json") for k in store.puts) >= 2:
            written.set()

    store.put = counted
    steps = itertools.count()
    monkeypatch.setattr(heartbeat, "progress", lambda: (next(steps), 1.0))
    watch = _Watch(lambda: store, "zrun", WarmSpec(worker="r0-w0", check_s=3600.0, progress_s=0.01), time.time(), print)
    watch.busy(0, 0, time.time())
    watch.start()
    try:
        assert written.wait(60), "the progress was not written twice while the lease is read once an hour"
    finally:
        watch.stopped.set()
        watch.join(5)


def test_a_profile_wait_reads_the_workers_status_at_its_cadence_not_at_each_reply_read(tmp_path):
    """Waiting for the profile, the coordinator reads each worker's reply on the control schedule
    (which never polls faster than it began: not the directory's 2 ms) and its status, to see
    whether it left on a notice, only every `status_every_s`: here never, the profile answering
    well before that (it read the status at every reply read)."""
    import threading

    from coordinator.workers.warm_pool import WarmWorker

    pool = _pool(tmp_path, 0)
    for rank in range(2):
        pool.workers[rank] = WarmWorker(rank=rank, name=f"r{rank}-w{rank}", launcher=_Launcher(), identity="x",
                                        launched_at=time.time(), billed_to=time.time(), ready_at=time.time())
    real_get, reads, enough = pool.store.get, {"reply": 0, "status": 0}, threading.Event()

    def get(key, *args, **kw):
        for kind in reads:
            reads[kind] += f"/{kind}" in key
        if reads["reply"] >= 20:
            enough.set()
        return real_get(key, *args, **kw)

    pool.store.get = get

    def answer():
        enough.wait(60)
        now = time.time()
        for w in pool.workers.values():
            pool.store.put(reply_key(pool.ctx.run_id, w.name, 0), json.dumps(
                {"ok": True, "profile": {"rank": w.rank}, "began_at": now, "ended_at": now}).encode())

    replier = threading.Thread(target=answer)
    replier.start()
    try:
        answers = pool.profile(SimpleNamespace(workers=2), [{}, {}], timeout_s=600.0)
    finally:
        enough.set()
        replier.join()
    assert answers == [{"rank": 0}, {"rank": 1}]
    assert pool.cadence.status_every_s >= 1.0 and reads["reply"] >= 20 and reads["status"] == 0

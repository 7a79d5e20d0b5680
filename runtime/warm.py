"""A warm worker: one process that serves a run's epochs, one command at a time, through the store.

A cold worker lives for one epoch: it imports torch, builds the model, reads its data,
trains a fraction of a second and exits. A warm worker is started once per rank and then
waits for the coordinator's commands, so it imports once, builds the model once
(`models.keep_models`), reads each data subset once (`datasets.keep_subsets`) and keeps its
CUDA context. The coordinator side is `coordinator.workers.warm_pool`.

Keys (`core.keys`), all under `runs/<run_id>/warm/` of the channel's store
(`RunContext.channel_ref`: the run's Redis where it has one, whose requests are free and fast,
else its durable store; teardown deletes them). A restart that empties Redis (no persistence)
loses nothing in flight: the idle worker puts its last reply back and the coordinator a command
it finds gone (`Store.keeps_keys`); the lease is renewed anyway:

| key | written by | what |
|---|---|---|
| `lease` | coordinator | `{"seq", "at"}`, renewed every `lease_s / 4` seconds |
| `<worker>/cmd-<n>.json` | coordinator | the worker's n-th command: `{"op": "epoch", "spec": WorkerSpec}`, `{"op": "profile", "request": ProfileRequest}` or `{"op": "stop"}` |
| `<worker>/reply-<n>.json` | worker | `{"ok", "result": WorkerResult` (or `"profile"`)`, "began_at", "ended_at", "ready_at"}` or the error |
| `<worker>/status.json` | worker | at start, then at most every `progress_s` while it changed: state (`idle`, `busy`; `preempted`, written at once, when it left on the provider's notice outside an epoch), pid, steps done this epoch, last beat; `noticed_at`, written at once, when the notice came and it works through it |
| `<worker>/release` | coordinator | the successor of a worker working through the notice is ready: hand over and leave |

`<worker>` is `r<rank>-w<serial>-<coordinator>`, or `spare-w<serial>-<coordinator>` for a warm
spot spare (it serves the rank its first command names): a replacement of a dead worker has a new
serial, and a resumed run's coordinator a new mark, so no worker reads a command meant for
another.

Every read and write here is a billed request on a cloud store, so the channel is paced by
what it is for, not by the clock: a command is seen at most 2 % of the worker's idle time
late (`core.polling.control_pause`), the status carries progress for the coordinator's
stall timeout (`progress_s`, a fraction of it) and the coordinator reads replies, not
statuses, to know an epoch ended.

The provider's notice (spot capacity, `WarmSpec.notice_s` > 0): the worker does not leave at
once. Its status says `noticed_at` at once; its pool starts a successor for its rank and, once
that one is ready, writes `release`; until then (at most `core.notice.work_through_s` after the
notice) the worker goes on serving: an epoch in progress trains on and hands over at the step
boundary after the release (`engine.preemption.due`), an idle worker takes the next command.
So its peers wait for no start-up. With no notice time (`notice_s` 0, a notice shorter than the
margin) it leaves at once, as outside spot capacity.

The lease keeps paid workers from outliving their run. A worker reads the lease every
`check_s` seconds and counts its age on its own monotonic clock from the last time the
value changed (no clock is shared with the coordinator); once older than `lease_s` the
worker stops: while idle at once, while training at the next heartbeat of its training
thread (`LeaseExpired`), and if that thread does not beat for `grace_s` more, by exiting
the process (`LEASE_EXIT`).

A command that raises ends the worker after its error reply: the coordinator replaces it
with a cold one (a process after a failed epoch may hold half-released resources), and the
exit status is the one a cold worker would have had.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from comm import heartbeat
from comm.store import Store, open_store
from core.errors import LeaseExpired, Preempted, ZooidValueError
from core.keys import command_key, lease_key, release_key, reply_key, status_key
from core.notice import work_through_s
from core.polling import control_pause
from core.process_start import process_started_at
from core.specs import WarmSpec, WorkerResult, WorkerSpec
from engine import preemption
from engine.chaos import chaos_for
from runtime.store_report import also_report, unreported

LEASE_EXIT = 5
"""Exit status of a warm worker whose lease expired while its training thread was stuck."""

PREEMPTED = "preempted"
"""The state in a warm worker's status that left on the provider's notice outside an epoch."""

RELEASE_CHECK_S = 0.5
"""Once the notice came, the least time between two reads of the worker's `release` key."""
NOTICE_CHECK_S = 0.25
"""How often the watch thread looks for a notice to publish (no request unless one came)."""

def worker_name(rank: int, serial: int, coordinator: str = "") -> str:
    """The name of one warm worker process: its rank, a serial unique within its coordinator,
    and the coordinator's mark (a resumed run's new coordinator never reuses a name)."""
    return f"r{rank}-w{serial}" + (f"-{coordinator}" if coordinator else "")


def spare_name(rank: int, serial: int, coordinator: str = "") -> str:
    """The name of a spare warm worker (`coordinator.workers.warm_pool`): it serves whichever rank
    it is given, so its name holds none (`rank` is unused, as `worker_name`'s signature)."""
    return f"spare-w{serial}" + (f"-{coordinator}" if coordinator else "")


def read_json(store: Store, key: str) -> dict | None:
    """The JSON document under `key`, or None when absent."""
    try:
        return json.loads(store.get(key))
    except KeyError:
        return None


class LeaseClock:
    """The age of a lease as one reader sees it: seconds since its value last changed, on the
    reader's clock. A lease never seen is as old as the reader."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self.value: bytes | None = None
        self.changed_at = clock()

    def observe(self, value: bytes | None) -> None:
        if value is not None and value != self.value:
            self.value, self.changed_at = value, self.clock()

    @property
    def age_s(self) -> float:
        return self.clock() - self.changed_at

    @property
    def expired(self) -> bool:
        return self.age_s > self.lease_s


class _Watch(threading.Thread):
    """The worker's second thread: reads the lease and publishes the worker's status."""

    def __init__(self, store_factory: Callable[[], Store], run_id: str, settings: WarmSpec,
                 started_at: float, log: Callable[[str], None]):
        super().__init__(name="warm-watch", daemon=True)
        self.store_factory, self.run_id, self.settings, self.log = store_factory, run_id, settings, log
        self.lease = LeaseClock(settings.lease_s)
        self.expired = threading.Event()
        self.stopped = threading.Event()
        self.doc = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": started_at,
                    "state": "starting", "seq": 0, "epoch": None}
        self.busy_since: float | None = None
        self.written: dict | None = None
        """The status last written (without its time), and when (monotonic): the first is the
        start's (`_start`), so the watch writes none before it."""
        self.written_at = time.monotonic()
        self.writing = threading.Lock()
        """Held while a status is written: the last one written is the newest."""

    def run(self) -> None:
        store = self.store_factory()
        also_report(store)  # its lease reads and status posts: in the epochs' results
        try:
            lease_read_at = None
            while not self.stopped.is_set():
                if lease_read_at is None or time.monotonic() - lease_read_at >= self.settings.check_s:
                    lease_read_at = time.monotonic()
                    try:
                        self.lease.observe(store.get(lease_key(self.run_id)))
                    except KeyError:
                        pass
                    except Exception as exc:  # a store that blips is not a lost coordinator
                        self.log(f"zooid warm worker: lease read failed ({type(exc).__name__}: {exc})")
                if self.lease.expired and not self.expired.is_set():
                    self.log(f"zooid warm worker {self.settings.worker}: the coordinator's lease was not "
                             f"renewed for {self.lease.age_s:.0f} s (worker_lease_s={self.settings.lease_s:g}); "
                             "stopping: no paid worker outlives its run")
                    self.expired.set()
                if preemption.noticed_at() and "noticed_at" not in self.doc:  # at once: its pool starts a successor
                    self.doc["noticed_at"] = preemption.noticed_at()
                    self.publish(store)
                self.publish_due(store)
                if self.expired.is_set() and self.busy_since is not None:
                    steps, beat_at = heartbeat.progress()
                    if time.time() - beat_at > self.settings.grace_s:
                        self.log("zooid warm worker: the training thread did not stop; exiting")
                        os._exit(LEASE_EXIT)
                # awake for whichever is due first: the lease's read, the progress's write, a notice
                self.stopped.wait(min(self.settings.check_s, self.settings.progress_s, NOTICE_CHECK_S))
        finally:
            store.close()

    def status(self) -> dict:
        """The status as it stands: the document and the training thread's progress."""
        steps, beat_at = heartbeat.progress()
        return {**self.doc, "steps": steps, "beat_at": beat_at}

    def publish_due(self, store: Store) -> None:
        """Write the status if it changed and `progress_s` passed since the last write."""
        if self.status() != self.written and time.monotonic() - self.written_at >= self.settings.progress_s:
            self.publish(store)

    def publish(self, store: Store) -> None:
        """Write the status now (`store`: a client of the calling thread's own)."""
        with self.writing:
            doc = self.status()
            try:
                store.put(status_key(self.run_id, self.settings.worker),
                          json.dumps({**doc, "written_at": time.time()}).encode(), scratch=True)
                self.written, self.written_at = doc, time.monotonic()
            except Exception:
                pass

    def busy(self, seq: int, epoch: int | None, since: float) -> None:
        """Command `seq` runs from `since` (an epoch's number; None for a profile)."""
        self.busy_since = since
        self.doc.update(state="busy", seq=seq, epoch=epoch)

    def idle(self, seq: int) -> None:
        """Command `seq` is answered: waiting for the next."""
        self.busy_since = None
        self.doc.update(state="idle", seq=seq + 1)


def serve(spec: WorkerSpec, store: Store, execute: Callable[[WorkerSpec], WorkerResult],
          store_factory: Callable[[], Store], log: Callable[[str], None] | None = None,
          open_ref: Callable[[str], Store] | None = None) -> str:
    """Serve the run's commands until told to stop; return why it stopped (`stopped`).

    `spec` is the launch spec (run id, rank, `warm`); `store` holds the commands;
    `execute(spec)` trains one epoch; `store_factory()` opens a second client of the same
    store for the watch thread; `log(line)` reports (default `print`, looked up at each call:
    a flow run's `log_prints` replaces it while it runs, after this module was imported);
    `open_ref(url)` opens the store a `profile` command probes (default
    `comm.store.open_store`). Raises `LeaseExpired` when the lease runs out, and whatever
    `execute` raised after posting it as the reply."""
    notice = _Notice(spec, store_factory)
    settings = spec.warm
    if settings is None:
        raise ZooidValueError("warm", "a warm worker's launch spec needs its WarmSpec")
    # the provider's notice outside an epoch: mark, leave at once; with notice time, work through
    # it from here on (a notice while it starts: it starts, and serves until released)
    with preemption.leaving(notice.mark), \
            preemption.overlapping(work_through_s(settings.notice_s), _Release(store, spec.run_id, settings.worker)):
        worker = _start(spec, store, store_factory, log or (lambda line: print(line)))
        notice.watch = worker.watch
        seq = 0
        try:
            while True:
                command = _next_command(store, spec.run_id, worker.settings, seq, worker.watch, worker.last_reply)
                if _obey(worker, seq, command, execute, open_ref):
                    return "stopped"
                seq += 1
                if preemption.due():  # the notice came (and is due) as the epoch ended: answered, leave
                    preemption.leave_now()
        finally:
            heartbeat.set_guard(None)
            worker.watch.stopped.set()
            worker.watch.join(timeout=5)


class _Release:
    """Whether the pool released this worker (`release_key`: its successor is ready), read at
    most every `RELEASE_CHECK_S` and only once the notice came (each read is a request)."""

    def __init__(self, store: Store, run_id: str, worker: str):
        self.store, self.key = store, release_key(run_id, worker)
        self.read_at, self.seen = float("-inf"), False

    def __call__(self) -> bool:
        if self.seen or not preemption.noticed_at() or time.monotonic() - self.read_at < RELEASE_CHECK_S:
            return self.seen
        self.read_at = time.monotonic()
        try:
            self.store.get(self.key)
            self.seen = True
        except KeyError:
            pass
        return self.seen


class _Notice:
    """What a warm worker does when the provider's notice comes outside an epoch
    (`engine.preemption.leaving`): its status says `preempted` (with when the notice came and
    when it left), which its pool reads (`coordinator.workers.warm_pool`) to bill its last
    interval as preempted and replace it at the next epoch, without waiting for a timeout."""

    def __init__(self, spec: WorkerSpec, store_factory: Callable[[], Store]):
        self.spec, self.store_factory = spec, store_factory
        self.watch: _Watch | None = None
        """The lease watch, once started: it stops publishing, and its status says preempted."""

    def mark(self) -> None:
        """Write the status `preempted` through a client of its own (the main thread's may be
        in the middle of a request)."""
        settings = self.spec.warm
        marks = {"state": PREEMPTED, "noticed_at": preemption.noticed_at() or time.time(), "left_at": time.time(),
                 "capacity": self.spec.capacity}
        if self.watch is not None:
            self.watch.stopped.set()
            self.watch.join(timeout=1.0)  # a status it is writing must not land after this one
            self.watch.doc.update(marks)
            doc = {**self.watch.doc, "written_at": time.time()}
        else:
            doc = {"pid": os.getpid(), "host": socket.gethostname(), "seq": 0, "epoch": None, **marks}
        store = self.store_factory()
        try:
            store.put(status_key(self.spec.run_id, settings.worker), json.dumps(doc).encode(), scratch=True)
        finally:
            store.close()


@dataclass
class _Serving:
    """What each step of `serve` shares: the command store, the run, this worker's settings,
    its watch thread, when it became ready, and where it reports."""

    store: Store
    run_id: str
    settings: WarmSpec
    watch: _Watch
    ready_at: float
    log: Callable[[str], None]
    spec: WorkerSpec | None = None
    """The launch spec (`engine.chaos` aims faults at it)."""
    last_reply: tuple[str, bytes] | None = None
    """The key and bytes of the last reply posted (put again where the store lost it, `_next_command`)."""

    def reply(self, seq: int, doc: dict) -> None:
        """Post the reply to command `seq`."""
        self.last_reply = (reply_key(self.run_id, self.settings.worker, seq), json.dumps(doc).encode())
        self.store.put(*self.last_reply)


def _start(spec: WorkerSpec, store: Store, store_factory: Callable[[], Store],
           log: Callable[[str], None]) -> _Serving:
    """Start up: keep the models and data subsets, start the lease watch and the training
    thread's guard, publish the `idle` status at once and say how long the start took."""
    # torch and the engine, imported when a worker starts serving: the coordinator imports
    # this module (coordinator.workers.warm_pool: read_json, worker_name) and runs without torch.
    from engine.datasets import keep_subsets  # torch: see above
    from engine.models import keep_models  # torch: see above
    from profiling.memory import rss_bytes  # torch: see above

    settings = spec.warm  # checked by `serve`
    started = time.time()
    base_memory = rss_bytes()  # before any model: s0 of the memory model (`profiling.profile_job`)
    keep_models()
    keep_subsets()
    watch = _Watch(store_factory, spec.run_id, settings, started, log)
    watch.start()
    also_report(store)  # its waits for commands and its replies: in the next epoch's result

    def guard() -> None:
        if watch.expired.is_set():
            raise LeaseExpired(f"lease not renewed for {watch.lease.age_s:.0f} s")

    heartbeat.set_guard(guard)
    ready_at = time.time()
    watch.doc.update(state="idle", ready_at=ready_at, base_memory_bytes=base_memory)
    watch.publish(store)  # at once: a coordinator on a shared host waits for it to profile
    began_at, since = process_started_at()
    log(f"zooid warm worker {settings.worker} ready {max(0.0, ready_at - began_at):.3f} s after its {since} "
        f"(interpreter, imports of torch and the store client, the store's connection, the lease watch; "
        f"pid {os.getpid()})")
    return _Serving(store, spec.run_id, settings, watch, ready_at, log, spec)


def _obey(worker: _Serving, seq: int, command: dict, execute: Callable[[WorkerSpec], WorkerResult],
          open_ref: Callable[[str], Store] | None) -> bool:
    """Carry out command `seq` and post its reply; True when it was `stop`."""
    op = command.get("op")
    if op == "stop":
        worker.reply(seq, {"ok": True, "stopped": True, "at": time.time()})
        worker.log(f"zooid warm worker {worker.settings.worker}: stopped by the coordinator "
                   f"({command.get('reason', 'no reason given')})")
        return True
    if op == "profile":
        _serve_profile(worker, seq, command, open_ref)
    elif op == "epoch":
        _run_epoch(worker, seq, command, execute)
    else:
        raise ZooidValueError("command.op", f"must be 'epoch', 'profile' or 'stop', got {op!r}")
    return False


def _run_epoch(worker: _Serving, seq: int, command: dict, execute: Callable[[WorkerSpec], WorkerResult]) -> None:
    """Train the epoch an `epoch` command names and post its result; an epoch that raises
    posts its error and raises it on (the worker ends; on the notice, `Preempted`, it leaves at
    once: `engine.preemption.leave_now`)."""
    job = WorkerSpec.from_dict(command["spec"])
    began = time.time()
    heartbeat.reset_steps()
    worker.watch.busy(seq, job.epoch, began)
    try:
        result = execute(job)
    except BaseException as exc:
        worker.reply(seq, {**_failure(exc), "began_at": began, "ended_at": time.time(), "ready_at": worker.ready_at})
        if isinstance(exc, Preempted):
            # its handover and marker are written and the reply posted: leave now, with the
            # notice's exit status, rather than after the flow run winds down (on a busy host that
            # took past the grace's SIGKILL, measured: 29 s and more)
            preemption.leave_now(why=f"epoch {job.epoch} rank {job.rank} left on the notice: {exc}")
        raise
    ended = time.time()
    worker.reply(seq, {"ok": True, "result": result.to_dict(), "began_at": began, "ended_at": ended,
                       "ready_at": worker.ready_at})
    worker.watch.idle(seq)
    # What the epoch left in reference cycles (a user's model may hold one) would stay until the
    # collector's oldest generation runs, which an epoch's few Python allocations rarely trigger:
    # epoch after epoch, a warm worker's memory would grow by models. Collected now, after the
    # reply (off the coordinator's path): 0.1 s with torch and Prefect imported, measured here.
    del result
    gc.collect()
    worker.log(f"zooid warm worker {worker.settings.worker}: epoch {job.epoch} rank {job.rank} "
               f"attempt {job.attempt} done in {ended - began:.2f} s")


def _failure(exc: BaseException, stores: Iterable[Store] = ()) -> dict:
    """The reply's part that tells of a command that raised `exc`, with the requests made for it
    that no result reported (`runtime.run_spec`, or those of `stores` the command opened; the
    coordinator bills them)."""
    ops = getattr(exc, "store_ops", None)
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)[-2000:],
            "store_ops": ops if ops is not None else unreported(stores)}


def _serve_profile(worker: _Serving, seq: int, command: dict, open_ref: Callable[[str], Store] | None) -> None:
    """Answer a `profile` command (`profiling.profile_job`): measured here, on this worker's
    device and threads, with the store seen from here. A profile that fails is reported and
    the worker stays: nothing of a run's state was touched."""
    from profiling.profile_job import ProfileRequest, run_profile  # torch: as in serve, kept off the coordinator's path

    began = time.time()
    worker.watch.busy(seq, None, began)
    reply: dict = {"began_at": began, "ready_at": worker.ready_at}
    if worker.spec is not None:  # ZOOID_CHAOS `at=profile` (a preemption while profiling)
        chaos_for(worker.spec, worker.store).at_profile()
    opened: list[Store] = []

    def opening(url: str) -> Store:  # the store probe's client: its requests are billed with the reply
        opened.append((open_ref or open_store)(url))
        return opened[-1]

    try:
        request = ProfileRequest.from_dict(command.get("request") or {})
        reply.update(ok=True, profile=run_profile(request, opening,
                                                  base_memory_bytes=int(worker.watch.doc.get("base_memory_bytes") or 0)),
                     store_ops=unreported(opened))  # the probe's requests, and this worker's since its last reply
        worker.log(f"zooid warm worker {worker.settings.worker}: "
                   f"{_profiled(request.model, reply['profile'], time.time() - began)}")
    except Exception as exc:
        reply.update(_failure(exc, opened))
        worker.log(f"zooid warm worker {worker.settings.worker}: profile failed: {type(exc).__name__}: {exc}")
    reply["ended_at"] = time.time()
    worker.reply(seq, reply)
    worker.watch.idle(seq)


def _profiled(model: str, profile: dict, took_s: float) -> str:
    """What a `profile` command measured and how long each part took: the model (layers,
    step, memory) and the store probe (the run's store, timed from here)."""
    parts = []
    if "model_s" in profile:
        parts.append(f"profiled {model} in {profile['model_s']:.2f} s")
    if "store_s" in profile:
        parts.append(f"probed the store in {profile['store_s']:.2f} s")
    return (" and ".join(parts) or "profile answered") + f" ({took_s:.2f} s in all)"


def _next_command(store: Store, run_id: str, settings: WarmSpec, seq: int, watch: _Watch,
                  last_reply: tuple[str, bytes] | None = None) -> dict:
    """Wait for command `seq`, checking the lease between reads: read at the store's own pace
    at first, then at most `CONTROL_POLL_SHARE` of the time waited apart (`control_pause`,
    at most `check_s`): an idle worker costs few requests. On a store a restart may empty
    (`Store.keeps_keys` False), `last_reply` (key, bytes) is put again every `check_s` where it
    is gone: the coordinator may still be waiting for it (its command it puts again likewise)."""
    key = command_key(run_id, settings.worker, seq)
    began, pause = time.monotonic(), store.poll_first_s
    checked = began
    while True:
        if last_reply is not None and not store.keeps_keys and time.monotonic() - checked >= settings.check_s:
            checked = time.monotonic()
            if not store.exists(last_reply[0]):
                store.put(*last_reply)
        if watch.expired.is_set():
            raise LeaseExpired(f"{settings.worker}: lease not renewed for {watch.lease.age_s:.0f} s "
                               f"while waiting for a command")
        if preemption.due():  # working through the notice: released, or its time is spent
            preemption.leave_now()
        try:
            return json.loads(store.get(key))
        except KeyError:
            pass
        time.sleep(pause)
        pause = control_pause(pause, time.monotonic() - began, store.poll_max_s, settings.check_s)
        if preemption.noticed_at():  # working through the notice: see the release soon
            pause = min(pause, RELEASE_CHECK_S)

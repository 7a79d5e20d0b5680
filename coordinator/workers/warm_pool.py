"""Warm workers, the coordinator's side: one long-lived worker per rank, each epoch sent as
commands through the store (`runtime.warm` is the worker's side).

`WarmPool` starts the workers through the target's launcher (an inline process, or one
`worker` flow run per rank on a work pool), renews the run's lease, sends each epoch's
specs, waits for the replies while it watches the workers, replaces a worker that dies or
stops making progress with a cold one, and retires the ones a smaller plan no longer needs.

The bill: each worker's life, launch to stop, is cut into ledger rows by what it did:
`startup` (launch to ready), `busy` (an epoch), `profile` (measuring the model and the
store for the plan, `profiling.profile_job`), `idle` (ready and waiting: for the first
command, or between epochs while the coordinator checkpoints and plans), and
`failed_attempt` (the epoch it was in when it died). The rows of one worker add up to its
whole interval. Rows close as the replies come; `open_rows` bills what is still open, so
the ledger written after each epoch leaves no interval out.

On spot capacity the pool also keeps the job's `spot_spares` warm beside the plan's ranks
(`spare_count`): a preempted worker's rank goes to a spare at once (its start-up already paid) and a
new spare starts in its place, so the other replicas wait at their next sync for a command's round
trip, not for a new worker's start. A spare is billed like any worker (its rows carry a rank past
the plan's until it takes one); one that is preempted while it waits is replaced like an idle worker.

Working through the notice (a spot offer's `notice_s`, `WarmSpec.notice_s`; `runtime.warm`): a
worker that gets the provider's notice says so in its status (`noticed_at`) and works on. The pool
then starts its successor, as a spare reserved for its rank (`_work_through_notices`), as late as
lets it be ready before the worker's working time ends (`_successor_due`: the run's measured
start-ups), and none where the run, at its pace so far, ends within that time (`_outlasts`);
once the successor is ready it writes the worker's `release`: an epoch in progress hands over at
its next step boundary and the rank goes to the successor (`_replace`), a worker idle between
epochs is stopped there and the rank goes to the successor before the next epoch (`ensure`). So
a preemption costs the other replicas no start-up wait when the successor starts within the
notice's working time (`core.notice.work_through_s`: 90 s of Fargate Spot's 120 s).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from prefect.concurrency.sync import concurrency

from clouds.registry import is_cloud
from coordinator.workers.failures import FailureKind, classify_failure
from coordinator.workers.launchers import (
    FAILED,
    PAID_WORKERS_LIMIT,
    WorkerOutcome,
    WorkersFailed,
    launch_identity,
    make_launcher,
)
from core.cost_record import CostRecord
from core.keys import command_key, lease_key, release_key, reply_key, status_key, warm_prefix
from core.kinds import PIPELINED_STRATEGIES, SHARED_HOST_KINDS, Capacity, Strategy
from core.notice import work_through_s
from core.plan import Plan
from core.polling import control_pause
from core.specs import WarmSpec, WorkerResult, WorkerSpec
from core.store_ops import grouped_total
from core.warm_cadence import REPLY_POLL_CAP_S, REPLY_POLL_S, WarmCadence
from coordinator.workers.preemptions import spot_spares
from planners.prestart import startup_estimate
from runtime.warm import PREEMPTED, read_json, spare_name, worker_name

SUCCESSOR_CHECK_S = 1.0
"""The least time between two reads of a starting successor's status (`_successor_ready`)."""
SUCCESSOR_MARGIN_S = 10.0
"""Seconds a successor is launched ahead of the start-up it is expected to take (`_successor_due`):
the pool looks at a noticed worker about once a second, and a start on a busy host runs late."""


class LeaseRenewer(threading.Thread):
    """Renews the run's lease every `every_s` seconds until stopped (its own store client)."""

    def __init__(self, open_store: Callable[[], Any], run_id: str, every_s: float):
        super().__init__(name="zooid-lease", daemon=True)
        self.open_store, self.run_id, self.every_s = open_store, run_id, every_s
        self.stopped = threading.Event()
        self.renewed = threading.Event()
        self.seq = 0

    def run(self) -> None:
        store = self.open_store()
        try:
            while not self.stopped.is_set():
                self.seq += 1
                try:
                    store.put(lease_key(self.run_id), json.dumps({"seq": self.seq, "at": time.time()}).encode())
                    self.renewed.set()
                except Exception as exc:  # workers outlive a short blip: the lease is minutes
                    print(f"zooid: lease renewal failed: {type(exc).__name__}: {exc}")
                self.stopped.wait(self.every_s)
        finally:
            store.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)


@dataclass
class Command:
    """One epoch command in flight on one worker."""

    seq: int
    spec: WorkerSpec
    outcome: WorkerOutcome
    """The attempt as the epoch sees it (sent to reply)."""


@dataclass
class WarmWorker:
    """One warm worker process (or flow run) of one rank."""

    rank: int
    name: str
    launcher: Any
    identity: str
    launched_at: float
    seq: int = 0
    """Commands sent so far."""
    billed_to: float = 0.0
    ready_at: float | None = None
    command: Command | None = None
    steps: int = 0
    progress_at: float = 0.0
    """Coordinator time the worker last showed progress (a new beat or step)."""
    beat_at: float = 0.0
    status_read_at: float = 0.0
    slot: Any = None
    """Its paid-worker concurrency slot, released when it stops."""
    price_per_s: float = 0.0
    """What it costs per second, at the size and capacity it was launched with."""
    capacity: str = ""
    """The capacity it runs on (`core.kinds.Capacity`)."""
    list_price_per_s: float = 0.0
    """What the same worker costs per second on-demand (`CostRecord.list_price_per_s`)."""
    preempted: bool = False
    """It died of the provider's notice outside an epoch (while profiling, or idle between
    epochs): its last row says so."""
    left_at: float | None = None
    """When it left on the notice, by its own status (`runtime.warm`): where its bill ends."""
    noticed_at: float | None = None
    """When the provider's notice came, by its status, while it works through it."""
    released: bool = False
    """The pool wrote its `release` (its successor is ready)."""
    reserved_for: int | None = None
    """A spare started as the successor of this rank's noticed worker (only that rank takes it)."""
    ready_seen: bool = False
    """A spare's status said it is ready (read at most every `SUCCESSOR_CHECK_S`)."""
    checked_at: float = 0.0

    @property
    def process(self) -> WorkerOutcome:
        """The launcher's record of the process or flow run itself."""
        return self.launcher.outcomes[0]

    @property
    def alive(self) -> bool:
        return self.process.status == "running"


@dataclass
class WarmPool:
    """A run's warm workers (`RunContext.warm`)."""

    ctx: Any
    workers: dict[int, WarmWorker] = field(default_factory=dict)
    serial: int = 0
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    """This coordinator's mark in its workers' names (a resumed run's workers never share one)."""
    renewer: LeaseRenewer | None = None
    store: Any = None
    spares: list[WarmWorker] = field(default_factory=list)
    """Warm spot workers beside the plan's ranks, oldest first (`spare_count`)."""
    epoch_began: dict = field(default_factory=dict)
    """When each epoch's workers were made ready (`ensure`), by epoch: the run's pace so far."""

    @property
    def cadence(self) -> WarmCadence:
        """The channel's periods for the job (`core.warm_cadence`)."""
        return WarmCadence(self.ctx.job.worker_lease_s, self.ctx.job.worker_timeout_s)

    # --- lifecycle ------------------------------------------------------------------

    def _open(self) -> None:
        if self.store is None:
            # the channel's store (`RunContext.channel_ref`): the run's Redis where it has one (a
            # restart that empties it is survived: `_repost`), else the durable store
            self.store = self.ctx.open_channel()
            # a coordinator that died (resume) leaves its commands and replies behind
            self.store.delete_prefix(warm_prefix(self.ctx.run_id) + "/")
        if self.renewer is None:
            self.renewer = LeaseRenewer(self.ctx.open_channel, self.ctx.run_id, self.cadence.renew_s)
            self.renewer.start()
            self.renewer.renewed.wait(10)

    def ensure(self, plan, epoch: int) -> list[int]:
        """Workers for ranks 0..plan.workers-1: start the missing ones (and replace those whose
        launch no longer fits the plan: another size or image), retire the rest. Returns the
        ranks started."""
        self._open()
        self.epoch_began.setdefault(epoch, time.time())
        launcher = make_launcher(self.ctx, plan)
        for rank in [r for r in self.workers if r >= plan.workers]:
            self.retire(rank, "the plan needs fewer workers")
        started = []
        for rank in range(plan.workers):
            w, identity = self.workers.get(rank), launch_identity(launcher, rank)
            gone = w is not None  # a rank that had a worker gets a spare where one is ready
            if w is not None and self._left_on_notice(w):  # preempted while idle: replaced now
                self._bury(w, "it was preempted while idle")
                w = None
            if w is not None and w.noticed_at is not None and self._successor_ready(w.rank):
                self._hand_to_successor(w)  # idle, working through the notice: its successor takes over now
                w = None
            if w is not None:
                w.launcher._poll()
            if w is not None and not w.alive:  # died between epochs or starting: billed as what it died of
                self._bury(w, "it stopped before its epoch")
                w = None
            if w is not None and w.alive and w.identity == identity:
                continue
            if w is not None:
                self.retire(rank, "its launch no longer fits the plan" if w.alive else "it stopped")
            if gone:
                self._replace(rank, plan, epoch)
            else:
                self._start(rank, plan, epoch, make_launcher(self.ctx, plan), identity)
            started.append(rank)
        self.keep_spares(plan, epoch)
        self._work_through_notices(plan, epoch)
        return started

    # --- spares ---------------------------------------------------------------------

    def spare_count(self, plan) -> int:
        """The spares `plan` keeps: on spot capacity, `preemptions.spot_spares`; none on-demand."""
        if str(getattr(plan, "capacity", Capacity.ON_DEMAND)) != Capacity.SPOT:
            return 0
        return spot_spares(self.ctx.job, plan)

    def keep_spares(self, plan, epoch: int) -> None:
        """Bury the spares that died or left on the notice, retire those that no longer fit
        `plan` (another size, image or capacity than its rank 0's), and start new ones up to
        `spare_count(plan)`."""
        want, identity = self.spare_count(plan), launch_identity(make_launcher(self.ctx, plan), 0)
        capacity = str(getattr(plan, "capacity", Capacity.ON_DEMAND))
        self._bury_gone_spares()
        for w in list(self.spares):
            if w.reserved_for is not None:  # a noticed worker's successor: kept while that worker works on
                if self._noticed(w.reserved_for) is not None and w.reserved_for < plan.workers:
                    continue
                w.reserved_for = None
            if w.identity != identity or w.capacity != capacity or len(self._free_spares()) > want:
                self.spares.remove(w)
                self._stop([w], "the plan needs no such spare", grace_s=10.0)
        while len(self._free_spares()) < want:
            launcher = make_launcher(self.ctx, plan)
            self.spares.append(self._launch(plan.workers + len(self.spares), plan, epoch, launcher, identity,
                                            spare=True))

    def _free_spares(self) -> list[WarmWorker]:
        """The spares no noticed worker's successor (`reserved_for`): the job's `spot_spares`."""
        return [w for w in self.spares if w.reserved_for is None]

    # --- working through the notice -------------------------------------------------

    def _noticed(self, rank: int) -> WarmWorker | None:
        """Rank `rank`'s worker while it works through the provider's notice, else None."""
        w = self.workers.get(rank)
        return w if w is not None and w.noticed_at is not None and not w.preempted else None

    def _successor(self, rank: int) -> WarmWorker | None:
        return next((s for s in self.spares if s.reserved_for == rank), None)

    def _work_through_notices(self, plan, epoch: int) -> None:
        """For each worker working through the notice: give its rank a successor if none is alive
        (a live spare of the job's, reserved for the rank, else a new one started on the worker's
        own capacity where the run outlasts the worker's working time: `_outlasts`), and write the
        worker's `release` once the successor is ready."""
        for w in list(self.workers.values()):
            if w.noticed_at is None or w.preempted or w.released:
                continue
            s = self._successor(w.rank)
            if s is not None and not s.alive:
                self.spares.remove(s)
                self._bury(s, "a successor stopped while it started")
                s = None
            if s is None:
                launcher = make_launcher(self.ctx, plan)
                identity = launch_identity(launcher, w.rank)
                s = next((f for f in self._free_spares() if f.alive and f.identity == identity
                          and f.capacity == w.capacity), None)  # a warm spare of the job's: already paid for
                if s is None and not self._outlasts(w, epoch, plan):
                    continue  # it works through its notice to the run's end: no successor to pay for
                if s is None and not self._successor_due(w):
                    continue  # its successor would be ready long before it must leave: judged again later
                if s is None:
                    s = self._launch(plan.workers + len(self.spares), plan, epoch, launcher, identity, w.capacity,
                                     spare=True)
                    self.spares.append(s)
                s.reserved_for = w.rank
                print(f"zooid: warm worker {w.name} (rank {w.rank}) got the provider's notice; it works on "
                      f"while its successor {s.name} starts")
            elif w.command is not None and self._successor_ready(w.rank):
                self.store.put(release_key(self.ctx.run_id, w.name), b"{}")
                w.released = True
                print(f"zooid: {s.name} is ready: {w.name} hands rank {w.rank} over at its next step")

    def _works_until(self, w: WarmWorker) -> float:
        """When noticed worker `w`'s working time ends (`core.notice.work_through_s` after its notice)."""
        return w.noticed_at + work_through_s(self._notice_s(w.capacity))

    def _outlasts(self, w: WarmWorker, epoch: int, plan) -> bool:
        """Whether the run, at its pace so far (the median time between two epochs' starts, over
        the epochs left from `epoch` on, this one whole), ends after worker `w`'s notice working
        time: only then does its rank need a successor. Before two epochs have started, at the
        plan's predicted epoch (`predicted_epoch_s`; judged again at each look, `_successor_due`,
        so the measured pace takes over as soon as there is one); True without either."""
        began = [self.epoch_began[e] for e in sorted(self.epoch_began)]
        gaps = [b - a for a, b in zip(began, began[1:])]
        pace = statistics.median(gaps) if gaps else float(getattr(plan, "predicted_epoch_s", 0.0) or 0.0)
        if pace <= 0 or w.noticed_at is None:
            return True
        left_s = pace * max(1, int(self.ctx.job.epochs) - epoch)
        return time.time() + left_s > self._works_until(w)

    def _successor_due(self, w: WarmWorker) -> bool:
        """Whether noticed worker `w`'s successor must be launched now to be ready before `w`'s
        working time (`core.notice.work_through_s`) ends: that time left is no more than the
        start-up this run's workers took (`planners.prestart.startup_estimate` of its samples; the
        target's `startup_s`, the start-up its owner expects, where that is longer) and
        `SUCCESSOR_MARGIN_S`. Until then the run's pace is judged again at each look
        (`_outlasts`): a notice that came before the pace was known (while the workers started or
        trained their first epoch) costs no successor where the run turns out to end within the
        worker's working time. Due at once before any start-up was measured."""
        if w.noticed_at is None or not self.ctx.state.startup_samples:
            return True
        startup = max(startup_estimate(self.ctx.state.startup_samples), self.ctx.resolved.target.startup_s)
        return self._works_until(w) - time.time() <= startup + SUCCESSOR_MARGIN_S

    def _successor_ready(self, rank: int) -> bool:
        """Whether rank `rank`'s successor is ready: its status says so (read at most every
        `SUCCESSOR_CHECK_S`: each read is a request)."""
        s = self._successor(rank)
        if s is None or not s.alive:
            return False
        now = time.time()
        if not s.ready_seen and now - s.checked_at >= SUCCESSOR_CHECK_S:
            s.checked_at = now
            status = read_json(self.store, status_key(self.ctx.run_id, s.name)) or {}
            s.ready_seen = status.get("state") == "idle" and bool(status.get("ready_at"))
        return s.ready_seen

    def _hand_to_successor(self, w: WarmWorker) -> None:
        """Worker `w`, idle and working through the notice, leaves now (released, then stopped:
        billed to now as preempted); its rank goes to its ready successor."""
        self.store.put(release_key(self.ctx.run_id, w.name), b"{}")
        w.released, w.preempted, w.left_at = True, True, time.time()
        self._bury(w, "its successor is ready")

    def _replace(self, rank: int, plan, epoch: int, capacity: str | None = None) -> WarmWorker:
        """A worker for `rank` in place of one that is gone: a live spare of the same launch and
        capacity where the pool keeps one (a new spare then starts), else a new worker."""
        launcher = make_launcher(self.ctx, plan)
        identity = launch_identity(launcher, rank)
        capacity = str(capacity or getattr(plan, "capacity", Capacity.ON_DEMAND))
        self._bury_gone_spares()
        fits = [w for w in self.spares if w.identity == identity and w.capacity == capacity
                and w.reserved_for in (None, rank)]
        w = min(fits, key=lambda w: w.reserved_for != rank, default=None)  # its own successor first
        if w is None:
            w = self._start(rank, plan, epoch, launcher, identity, capacity)
        else:
            self.spares.remove(w)
            print(f"zooid: {'successor' if w.reserved_for == rank else 'spare'} {w.name} takes rank {rank}'s place")
            w.rank, w.reserved_for = rank, None
            self.workers[rank] = w
            attempt = self.ctx.state.cloud_attempts.get(w.process.ref)
            if attempt is not None:  # billed by the cloud's clock: its rows name the rank it serves
                self.ctx.state.cloud_attempts[w.process.ref] = (attempt[0], rank, *attempt[2:])
        self.keep_spares(plan, epoch)  # a spare taken or buried: a new one in its place
        return w

    def _bury_gone_spares(self) -> None:
        """Bury the spares that died or left on the provider's notice while they waited."""
        for w in list(self.spares):
            w.launcher._poll()
            if self._left_on_notice(w) or not w.alive:
                self.spares.remove(w)
                self._bury(w, "a spare stopped while it waited")

    def _start(self, rank: int, plan, epoch: int, launcher, identity: str, capacity: str | None = None) -> WarmWorker:
        """Launch worker `rank` on `capacity` (None: the plan's; a preempted rank's replacement
        may run on-demand, `coordinator.workers.preemptions`)."""
        worker = self._launch(rank, plan, epoch, launcher, identity, capacity)
        self.workers[rank] = worker
        return worker

    def _launch(self, rank: int, plan, epoch: int, launcher, identity: str, capacity: str | None = None,
                spare: bool = False) -> WarmWorker:
        """Launch one warm worker as rank `rank` (a spare: named as one, its rank past the plan's)."""
        ctx, job = self.ctx, self.ctx.job
        capacity = str(capacity or getattr(plan, "capacity", "on_demand"))
        name = (spare_name if spare else worker_name)(rank, self.serial, self.token)
        warm = WarmSpec(worker=name, lease_s=job.worker_lease_s, check_s=self.cadence.check_s,
                        progress_s=self.cadence.progress_s, notice_s=self._notice_s(capacity))
        spec = WorkerSpec(run_id=ctx.run_id, epoch=epoch, rank=rank, world=plan.workers,
                          store_url=ctx.channel_ref, model=job.model, dataset=job.dataset, subsets=(),
                          steps=0, batch_size=plan.batch_size or job.batch_size, lr=job.lr,
                          optimizer=job.optimizer, seed=job.seed, attempt=self.serial,
                          warm=warm, capacity=capacity)
        self.serial += 1
        slot = contextlib.ExitStack()  # no-op when the limit does not exist (deployments.bootstrap makes it)
        slot.enter_context(concurrency(PAID_WORKERS_LIMIT, occupy=1, timeout_seconds=job.worker_timeout_s,
                                       strict=False))
        outcome = launcher.launch(spec)
        ctx.state.launchers.append(launcher)
        price, list_price = ctx.price_of(plan, capacity)(rank), ctx.price_of(plan, "on_demand")(rank)
        if is_cloud(ctx.resolved.target):  # billed by the cloud's clock
            ctx.state.cloud_attempts[outcome.ref] = (None, rank, None, price, capacity, list_price)
        worker = WarmWorker(rank=rank, name=name, launcher=launcher, identity=identity,
                            launched_at=outcome.started_at, billed_to=outcome.started_at, slot=slot,
                            price_per_s=price, capacity=capacity, list_price_per_s=list_price)
        return worker

    def _notice_s(self, capacity: str) -> float:
        """The provider's notice on `capacity` (the spot offer's; 0 on-demand)."""
        spot = getattr(self.ctx.resolved, "spot", None)
        return float(getattr(spot, "notice_s", 0.0) or 0.0) if capacity == Capacity.SPOT else 0.0

    def prestart(self, workers: int, plan, epoch: int) -> list[int]:
        """Start ranks plan.workers..workers-1 now, sized as `plan`'s, for a next epoch known to
        need `workers` (they wait, billed, until it starts). Returns the ranks started."""
        self._open()
        started = []
        for rank in range(plan.workers, workers):
            if rank not in self.workers:
                launcher = make_launcher(self.ctx, plan)
                self._start(rank, plan, epoch, launcher, launch_identity(launcher, rank))
                started.append(rank)
        return started

    def profilers(self) -> int:
        """How many workers could take a profile request at once: the live ones (at least one:
        `profile` starts rank 0 where the pool has none)."""
        return max(1, sum(1 for w in self.workers.values() if w.alive))

    def profile(self, plan, requests: list[dict], timeout_s: float, poll_s: float = 0.05) -> list[dict]:
        """Have the pool's workers measure `requests` (`profiling.profile_job.ProfileRequest`s
        as dicts) at once, the first on rank 0's worker (started now, sized as `plan`'s, if the
        pool has none), the others on the next live ranks, each on its own device and threads;
        return their answers in order. Billed as start-up, idle and `profile` rows. Raises
        RuntimeError when a worker dies, fails its request or shows nothing for `timeout_s`,
        once every other request has its answer (each billed as `profile`, and the workers
        free for a retry), or has failed in turn (ValueError when the pool has fewer workers
        than requests, `profilers`)."""
        self._open()
        w = self.workers.get(0)
        if w is None or not w.alive:
            if w is not None:
                self.retire(0, "it stopped")
            launcher = make_launcher(self.ctx, plan)
            self._start(0, plan, 0, launcher, launch_identity(launcher, 0))
        if self.ctx.resolved.target.kind in SHARED_HOST_KINDS:  # their start-up would slow the timings taken
            self.wait_ready(timeout_s)
        live = [w for _, w in sorted(self.workers.items()) if w.alive]
        if len(requests) > len(live):
            raise ValueError(f"{len(requests)} profile requests for {len(live)} live worker(s)")
        pending, answers, sent = {}, [None] * len(requests), time.time()
        for i, (w, request) in enumerate(zip(live, requests)):
            pending[i] = (w, w.seq, w.ready_at is not None)
            self.store.put(command_key(self.ctx.run_id, w.name, w.seq),
                           json.dumps({"op": "profile", "request": request}).encode())
            w.seq += 1
        failures, pause = [], max(poll_s, self.store.poll_max_s)
        while pending:
            for i, (w, seq, ready) in list(pending.items()):
                reply = read_json(self.store, reply_key(self.ctx.run_id, w.name, seq))
                now = time.time()
                if reply is not None:
                    del pending[i]
                    # the profile's requests (the store probe's, or a failed one's: `runtime.warm`), billed with the workers'
                    self.ctx.state.store_ops = grouped_total([self.ctx.state.store_ops, reply.get("store_ops") or {}])
                    if ready and reply.get("began_at") and reply.get("ended_at"):  # a ready worker: the round trip
                        busy = float(reply["ended_at"]) - float(reply["began_at"])  # (durations only: no clock skew)
                        self.ctx.state.dispatch_samples.append(max(0.0, now - sent - busy))
                    self._bill_reply(w, reply, now, status="profile")
                    if reply.get("ok"):
                        answers[i] = reply["profile"]
                    else:
                        failures.append(RuntimeError(f"profiling on worker {w.name} failed: {reply.get('error')}: "
                                                     f"{reply.get('message', '')}"))
                    continue
                w.launcher._poll()
                notice_due = now - max(w.status_read_at, sent) >= self.cadence.status_every_s  # a read: a request
                if notice_due:
                    w.status_read_at = now
                if not w.alive or (notice_due and self._left_on_notice(w)):
                    del pending[i]
                    self._bury(w, "it died while profiling")  # a spot worker taken back: billed preempted
                    failures.append(RuntimeError(f"worker {w.name} exited while profiling: "
                                                 f"{w.process.error or w.process.status}"))
                elif now - sent > timeout_s:
                    del pending[i]
                    self.retire(w.rank, f"no profile within {timeout_s:.0f} s")
                    failures.append(RuntimeError(f"worker {w.name} gave no profile within {timeout_s:.0f} s"))
            if pending:  # each read is a billed request on a cloud store
                time.sleep(pause)
                pause = control_pause(pause, time.time() - sent, self.store.poll_max_s, REPLY_POLL_CAP_S)
        if failures:
            raise failures[0]
        return answers

    def wait_ready(self, timeout_s: float, poll_s: float = 0.02) -> None:
        """Wait until every live worker of the pool has started (its status says so; billed as
        start-up to then), or died, or `timeout_s` passed."""
        began = time.time()
        deadline, pause = began + timeout_s, max(poll_s, self.store.poll_max_s)
        waiting = [w for w in self.workers.values() if w.ready_at is None]
        while waiting and time.time() < deadline:
            for w in list(waiting):
                status = read_json(self.store, status_key(self.ctx.run_id, w.name)) or {}
                w.launcher._poll()
                if status.get("ready_at"):
                    self._mark_ready(w, float(status["ready_at"]), time.time(), None)
                if w.ready_at is not None or not w.alive:
                    waiting.remove(w)
            if waiting:
                time.sleep(pause)
                pause = control_pause(pause, time.time() - began, self.store.poll_max_s, REPLY_POLL_CAP_S)

    def retire(self, rank: int, reason: str, grace_s: float = 10.0) -> None:
        """Stop the worker of `rank` (asked through the store, then stopped by its launcher
        if it has not exited within `grace_s`), and bill it to its stop."""
        w = self.workers.pop(rank, None)
        if w is None:
            return
        self._stop([w], reason, grace_s)

    def stop_all(self, reason: str, grace_s: float = 10.0) -> None:
        """Stop every worker and the lease (teardown)."""
        workers, self.workers = list(self.workers.values()) + self.spares, {}
        self.spares = []
        self._stop(workers, reason, grace_s)
        if self.renewer is not None:
            self.renewer.stop()
            self.renewer = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def _stop(self, workers: list[WarmWorker], reason: str, grace_s: float) -> None:
        for w in workers:
            w.launcher._poll()
            if self.store is not None and w.noticed_at is None and not w.preempted and w.capacity == Capacity.SPOT:
                try:  # a notice not yet read (it came in the last epoch): billed as what it was
                    self._left_on_notice(w)
                except Exception:
                    pass
            if w.alive and w.command is None and self.store is not None:
                try:
                    self.store.put(command_key(self.ctx.run_id, w.name, w.seq),
                                   json.dumps({"op": "stop", "reason": reason}).encode())
                    self.ctx.state.asked_to_stop.add(w.process.ref)
                except Exception:
                    pass
        deadline = time.time() + grace_s
        while any(w.alive and w.command is None for w in workers) and time.time() < deadline:
            time.sleep(0.05)
            for w in workers:
                if w.alive:
                    w.launcher._poll()
        for w in workers:
            if w.alive:
                w.launcher.stop(f"warm worker stopped: {reason}")
            if w.launcher in self.ctx.state.launchers:
                self.ctx.state.launchers.remove(w.launcher)
            self._bill_end(w)

    # --- one epoch ------------------------------------------------------------------

    def run_epoch(self, plan, specs: list[WorkerSpec], timeout_s: float,
                  on_failure: Callable[[WorkerOutcome, WorkerSpec], WorkerSpec | None] | None = None,
                  on_tick: Callable[[], None] | None = None, poll_s: float = REPLY_POLL_S) -> tuple[list, list]:
        """Send `specs` (one per rank) and wait for every rank's reply. Returns (the final
        attempt of every rank, every attempt). A worker that dies, fails its epoch or shows no
        progress for `timeout_s` is stopped and passed to `on_failure`: a returned spec is sent
        to a cold replacement of that rank; None stops the epoch's other workers and raises
        `WorkersFailed`."""
        attempts: list[WorkerOutcome] = []
        for spec in specs:
            attempts.append(self._send(self.workers[spec.rank], spec))
        # replies are read every `poll_s` (`REPLY_POLL_S`) or the store's own poll where that
        # is slower, growing with the epoch's time (`control_pause`), one worker's a tick in turn
        # (`_read_turn`): each read is a billed request on a cloud store
        poll_s = pause = max(poll_s, self.store.poll_max_s)
        last_relaunch, began, tick = 0.0, time.time(), 0
        while True:
            now = time.time()
            self._read_turn(tick, now, max(timeout_s, 0.0), last_relaunch)
            tick += 1
            for w in [w for w in self.workers.values() if w.command is not None
                      and w.command.outcome.status in FAILED]:
                failed, spec = w.command.outcome, w.command.spec
                if w.alive:
                    w.launcher.stop("its epoch failed")
                try:  # classifies the failure (into failed.extra) before the bill closes
                    retry = on_failure(failed, spec) if on_failure else None
                except BaseException:
                    self._bury(w)
                    self._abort("another worker cannot be retried")
                    raise
                self._bury(w)
                if retry is None:
                    self._abort("another worker failed")
                    raise WorkersFailed(attempts, f"rank {failed.rank} {failed.status}")
                self._replace(spec.rank, plan, spec.epoch, capacity=retry.capacity)
                attempts.append(self._send(self.workers[spec.rank], retry))
                last_relaunch = time.time()
            latest = {o.rank: o for o in attempts}
            if all(o.status == "completed" for o in latest.values()):
                return [latest[r] for r in sorted(latest)], attempts
            self._work_through_notices(plan, specs[0].epoch)
            if on_tick is not None:
                on_tick()
            time.sleep(pause)
            pause = control_pause(pause, time.time() - began, poll_s, REPLY_POLL_CAP_S)

    def _read_turn(self, tick: int, now: float, timeout_s: float, last_relaunch: float) -> None:
        """Check every busy worker (`_check`), reading one reply a tick, in turn: the workers of
        an epoch end together (its last sync, its last micro-batch), so once one has answered
        the others' replies are read at once. A tick costs one request, not one per worker; a
        worker that died is read at once (its error reply)."""
        busy = [w for w in self.workers.values() if w.command is not None]
        if not busy:
            return
        turn = busy[tick % len(busy)]
        self._check(turn, now, timeout_s, last_relaunch)
        answered = turn.command is None
        for w in busy:
            if w is not turn:
                self._check(w, now, timeout_s, last_relaunch, read_reply=answered)

    def progress(self) -> tuple[int, int]:
        """(steps reported so far by the workers of the epoch in flight, their step target)."""
        busy = [w for w in self.workers.values() if w.command is not None]
        return sum(min(w.steps, w.command.spec.steps) for w in busy), sum(w.command.spec.steps for w in busy)

    def _send(self, w: WarmWorker, spec: WorkerSpec) -> WorkerOutcome:
        """Send `spec` to worker `w` as its next command; returns the attempt's outcome."""
        log = w.process.extra.get("log")
        outcome = WorkerOutcome(rank=spec.rank, attempt=spec.attempt, started_at=time.time(), ref=w.name,
                                extra={"worker": w.name, "warm": True, "process_ref": w.process.ref,
                                       "capacity": w.capacity,
                                       **({"log": log, "log_offset": _size(log)} if log else {})})
        w.command = Command(seq=w.seq, spec=spec, outcome=outcome)
        w.steps, w.progress_at, w.status_read_at = 0, outcome.started_at, outcome.started_at
        self.store.put(command_key(self.ctx.run_id, w.name, w.seq),
                       json.dumps({"op": "epoch", "spec": spec.to_dict()}).encode())
        return outcome

    def _check(self, w: WarmWorker, now: float, timeout_s: float, last_relaunch: float,
               read_reply: bool = True) -> None:
        """See whether the worker is alive, then read the reply of its command (with `read_reply`,
        or when it died: a reply written before it exited is still its answer); else see whether
        it hangs."""
        cmd = w.command
        w.launcher._poll()
        reply = read_json(self.store, reply_key(self.ctx.run_id, w.name, cmd.seq)) \
            if read_reply or not w.alive else None
        if reply is not None and reply.get("ok"):
            now = time.time()  # after the read: the reply may be younger than the poll
            got = reply["result"]
            if (got.get("epoch"), got.get("rank")) != (cmd.spec.epoch, cmd.spec.rank):
                raise RuntimeError(f"{w.name} answered epoch {got.get('epoch')} rank {got.get('rank')} "
                                   f"to a command for epoch {cmd.spec.epoch} rank {cmd.spec.rank}")
            cmd.outcome.result, cmd.outcome.status = WorkerResult.from_dict(got), "completed"
            cmd.outcome.stopped_at = now
            self._bill_reply(w, reply, now, epoch=cmd.spec.epoch, attempt=cmd.spec.attempt)
            w.command, w.seq = None, w.seq + 1
            return
        if reply is not None:  # the epoch raised; the worker exits with its status
            if cmd.outcome.error is None:  # its requests, billed once (the reply is read until it exits)
                self.ctx.state.store_ops = grouped_total([self.ctx.state.store_ops, reply.get("store_ops") or {}])
            cmd.outcome.error = f"{reply.get('error')}: {reply.get('message', '')}"
        status = None
        if not w.alive or now - w.status_read_at >= self.cadence.status_every_s:  # each read: a request
            w.status_read_at = now
            status = read_json(self.store, status_key(self.ctx.run_id, w.name)) or {}
        if status and status.get("noticed_at") and w.noticed_at is None:
            w.noticed_at = float(status["noticed_at"])  # working through the notice: a successor starts
        if reply is None and status and status.get("state") == PREEMPTED:
            # it left on the notice before it took this command (idle): a preemption, at once
            w.preempted, w.left_at = True, float(status.get("left_at") or now)
            cmd.outcome.extra["left_on_notice"] = status
        if not w.alive or "left_on_notice" in cmd.outcome.extra:
            process = w.process
            cmd.outcome.status = process.status if process.status in FAILED else "failed"
            cmd.outcome.stopped_at = w.left_at or process.stopped_at or now
            cmd.outcome.extra["exit_code"] = process.extra.get("exit_code")
            cmd.outcome.error = cmd.outcome.error or process.error or "left on the provider's notice"
            return
        if status is not None and reply is None and not self.store.keeps_keys:
            self._repost(w)
        if status is not None:
            if status.get("seq") == cmd.seq and status.get("state") == "busy":
                steps, beat = int(status.get("steps") or 0), float(status.get("beat_at") or 0.0)
                if steps != w.steps or beat != w.beat_at:
                    w.steps, w.beat_at, w.progress_at = steps, beat, now
        if now - max(w.progress_at, last_relaunch) > timeout_s:
            w.launcher.stop(f"no progress for {timeout_s:.0f} s")
            cmd.outcome.status, cmd.outcome.stopped_at = "timeout", time.time()
            cmd.outcome.error = f"no progress for {timeout_s:.0f} s"

    def _repost(self, w: WarmWorker) -> None:
        """On a channel a restart may empty (Redis without persistence, `Store.keeps_keys`):
        put `w`'s command in flight again where the store lost it, so that a worker still waiting
        for it gets it (the worker puts its last reply again likewise, `runtime.warm`). Read at the
        pace of the status reads; Redis's requests are free."""
        cmd = w.command
        key = command_key(self.ctx.run_id, w.name, cmd.seq)
        if not self.store.exists(key):
            print(f"zooid: {w.name}'s command {cmd.seq} is gone from the channel's store (a restart?): sent again")
            self.store.put(key, json.dumps({"op": "epoch", "spec": cmd.spec.to_dict()}).encode())

    def _left_on_notice(self, w: WarmWorker) -> dict | None:
        """The status of a worker that left on the provider's notice outside an epoch
        (`runtime.warm`: state `preempted`), or None; the worker is then marked preempted and
        billed to when it left. Read from the store: Prefect may show its flow run running a
        while after its container exited."""
        status = read_json(self.store, status_key(self.ctx.run_id, w.name)) if self.store is not None else None
        if status and status.get("noticed_at") and w.noticed_at is None:
            w.noticed_at = float(status["noticed_at"])  # working through the notice: a successor starts
        if not status or status.get("state") != PREEMPTED:
            return None
        w.preempted, w.left_at = True, float(status.get("left_at") or time.time())
        return status

    def _died_preempted(self, w: WarmWorker) -> bool:
        """Whether a worker that died outside an epoch was taken back by the provider: its status
        says so, or its exit does (`classify_failure`: exit 6, SIGTERM's status)."""
        if w.preempted or self._left_on_notice(w):
            return True
        code = w.process.extra.get("exit_code")
        return code != 0 and classify_failure(code, w.process.error or "").kind is FailureKind.PREEMPTED

    def _bury(self, w: WarmWorker, reason: str = "its epoch failed") -> None:
        """Stop a worker whose epoch failed (or that died outside one) and bill it; its rank gets
        a replacement."""
        if w.command is None and not w.alive:
            w.preempted = self._died_preempted(w)
        if w.preempted:
            print(f"zooid: warm worker {w.name} (rank {w.rank}, {w.capacity or 'on_demand'}) was preempted "
                  f"({reason}); its rank gets a new worker")
        if w.alive:
            w.launcher.stop(reason)
        if self.workers.get(w.rank) is w:
            del self.workers[w.rank]
        if w.launcher in self.ctx.state.launchers:
            self.ctx.state.launchers.remove(w.launcher)
        self._bill_end(w)

    def _abort(self, reason: str) -> None:
        """Stop every worker still in the epoch (they wait on peers that will not come)."""
        for w in [w for w in self.workers.values() if w.command is not None]:
            if w.command.outcome.status == "running":
                w.command.outcome.status, w.command.outcome.error = "cancelled", reason
                w.command.outcome.stopped_at = time.time()
            self._bury(w)

    # --- the bill -------------------------------------------------------------------

    def _row(self, w: WarmWorker, status: str, stop: float, epoch: int | None, attempt: int | None = None,
             kind: str = "worker") -> None:
        start = w.billed_to
        stop = max(start, stop)
        if stop > start or attempt is not None:  # an epoch's row stays, however short
            self.ctx.state.ledger.append(self._record(w, status, start, stop, epoch, attempt, kind))
        w.billed_to = stop

    def _record(self, w: WarmWorker, status: str, start: float, stop: float, epoch, attempt, kind) -> CostRecord:
        ctx = self.ctx
        return CostRecord(run_id=ctx.run_id, resource=f"worker {w.name}", kind=kind,
                          offer=ctx.offer_of(w.capacity).name if w.capacity else ctx.resolved.offer.name,
                          start=start, stop=stop, unit_price_per_s=w.price_per_s, status=status,
                          epoch=epoch, rank=w.rank, attempt=attempt, capacity=w.capacity,
                          list_price_per_s=w.list_price_per_s,
                          worker=w.process.ref if is_cloud(ctx.resolved.target) else w.name)

    def _bill_reply(self, w: WarmWorker, reply: dict, now: float, status: str = "busy",
                    epoch: int | None = None, attempt: int | None = None) -> None:
        """startup (first reply), idle, then the command's own row (`status`: an epoch is
        `busy`, a profile `profile`), from the worker's own times (clamped)."""
        if w.ready_at is None:
            self._mark_ready(w, float(reply.get("ready_at") or w.billed_to), now, epoch)
        began = min(float(reply.get("began_at") or now), now)
        ended = min(float(reply.get("ended_at") or now), now)
        self._row(w, "idle", began, epoch)
        self._row(w, status, ended, epoch, attempt)

    def _mark_ready(self, w: WarmWorker, ready_at: float, now: float, epoch: int | None) -> None:
        """The worker started at `ready_at` (its own clock, clamped to `now`): its start-up row."""
        w.ready_at = min(ready_at, now)
        self._row(w, "startup", w.ready_at, epoch)
        self.ctx.state.startup_samples.append(w.ready_at - w.launched_at)

    def _bill_end(self, w: WarmWorker) -> None:
        """Close the worker's bill at its stop (what was open is start-up, idle, or the epoch
        it failed in) and give its paid-worker slot back."""
        if w.slot is not None:
            try:
                w.slot.close()
            except Exception as exc:  # the API may be gone when the run crashed with it
                print(f"zooid: releasing {w.name}'s concurrency slot failed: {exc}")
            w.slot = None
        stop = w.left_at or w.process.stopped_at or time.time()
        if w.command is not None:
            o = w.command.outcome
            failure = o.extra.get("failure")
            status = o.status if not failure else f"{o.status}:{failure['kind']}"
            kind = "worker" if o.status == "completed" else "failed_attempt"
            self._row(w, status, stop, w.command.spec.epoch, w.command.spec.attempt, kind)
        else:  # a worker that got the notice was taken back, even where it worked through it to its stop
            taken = w.preempted or w.noticed_at is not None
            self._row(w, "preempted" if taken else "startup" if w.ready_at is None else "idle", stop, None)

    def open_rows(self, now: float | None = None) -> list[CostRecord]:
        """Rows for what the live workers have used since their last closed row (provisional:
        the ledger written mid-run must leave nothing unbilled)."""
        now = time.time() if now is None else now
        return [self._record(w, "open", w.billed_to, now, None, None, "worker")
                for w in [*self.workers.values(), *self.spares] if now > w.billed_to]


def _size(path: str) -> int:
    try:
        import os

        return os.path.getsize(path)
    except OSError:
        return 0


def warm_epoch_specs(specs: list[WorkerSpec], threads: int) -> list[WorkerSpec]:
    """The epoch's specs as commands: each carries the worker's thread count."""
    return [dataclasses.replace(s, compute=dataclasses.replace(s.compute, threads=threads)) for s in specs]


def provisional_plan(ctx):
    """The job's worker count and the target's worker size, before any plan: what the first
    warm workers are started with (the plan then adds, retires or resizes them)."""
    job, target = ctx.job, ctx.resolved.target
    stages = job.stages or 1 if job.strategy in PIPELINED_STRATEGIES else 1
    return Plan(strategy=job.strategy if job.strategy != Strategy.AUTO else Strategy.LOCAL_SGD, data_parallel=job.workers,
                stages=stages, batch_size=job.batch_size, worker_vcpu=target.worker_vcpu,
                worker_memory_gb=target.worker_memory_gb, worker_gpu=target.worker_gpu,
                capacity=provisional_capacity(ctx))


def provisional_capacity(ctx) -> str:
    """The capacity the first warm workers start on, before the plan resolves the job's: `spot`
    where the job asks for it, or asks `auto` on a target with a spot offer (the discount
    usually wins; a plan that says otherwise replaces them), else `on_demand`."""
    capacity = getattr(ctx.job, "capacity", Capacity.ON_DEMAND)
    if capacity == Capacity.AUTO:
        return str(Capacity.SPOT if getattr(ctx.resolved, "spot", None) is not None else Capacity.ON_DEMAND)
    return str(capacity)

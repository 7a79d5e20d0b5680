"""Warm spot spares (`coordinator.workers.warm_pool`): a spot plan keeps the job's `spot_spares`
beside its ranks; a preempted rank's place goes to a live spare of the same launch and capacity at
once, and a new spare starts; a spare preempted while it waits is billed as preempted and
replaced; on-demand plans and replacements keep none; teardown stops them and the mid-run ledger
bills them. The pool's launches are recorded, not started (the docker target's preemption tests
run the real path)."""
from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import pytest

from core.errors import ZooidValueError
from core.keys import release_key
from planners.catalog import spot_offer
from runtime.warm import status_key


class _Launcher:
    def __init__(self, rank: int):
        from coordinator.workers.launchers import WorkerOutcome

        self.outcomes = [WorkerOutcome(rank=rank, attempt=0, started_at=time.time(), ref=f"flow-{rank}-{time.time()}")]
        self.stopped = []

    def _poll(self):
        pass

    def stop(self, reason: str):
        self.stopped.append(reason)
        self.outcomes[0].status, self.outcomes[0].stopped_at = "cancelled", time.time()


def _pool(tmp_path, monkeypatch, spot_spares=1, capacity="spot", startup_s=0.0):
    from coordinator.run.context import RunContext
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import validate_job
    from coordinator.workers import warm_pool
    from coordinator.workers.warm_pool import WarmPool, WarmWorker

    job = TrainJob(model="digits_mlp", workers=2, store=f"file://{tmp_path}/store", warm=True,
                   spot_spares=spot_spares, capacity="auto")  # the plan below says which capacity
    resolved = validate_job(job)
    resolved = dataclasses.replace(resolved, spot=spot_offer("fargate-cpu", "docker"),  # billed as Fargate Spot
                                   target=resolved.target.model_copy(update={"startup_s": startup_s}))
    ctx = RunContext(run_id="zspare", job=job, resolved=resolved)
    pool = WarmPool(ctx)
    pool.store = ctx.open_durable()
    launched = []

    def launch(self, rank, plan, epoch, launcher, identity, capacity=None, spare=False):
        name = ("spare" if spare else f"r{rank}") + f"-w{self.serial}"
        self.serial += 1
        w = WarmWorker(rank=rank, name=name, launcher=_Launcher(rank), identity=identity, launched_at=time.time(),
                       billed_to=time.time(), capacity=str(capacity or plan.capacity), price_per_s=1e-5)
        launched.append((name, rank, w.capacity))
        return w

    monkeypatch.setattr(warm_pool, "make_launcher", lambda ctx, plan: None)
    monkeypatch.setattr(warm_pool, "launch_identity", lambda launcher, rank: "one-size")
    monkeypatch.setattr(WarmPool, "_open", lambda self: None)
    monkeypatch.setattr(WarmPool, "_launch", launch)
    plan = SimpleNamespace(workers=2, capacity=capacity, stage_memory_gb=())
    return pool, plan, launched


def test_a_spot_plan_keeps_the_spares_the_job_asks_for_and_none_by_default(tmp_path, monkeypatch):
    pool, plan, launched = _pool(tmp_path, monkeypatch)
    assert pool.ensure(plan, 0) == [0, 1]
    assert [n for n, _, _ in launched] == ["r0-w0", "r1-w1", "spare-w2"] and len(pool.spares) == 1
    assert pool.spares[0].rank == 2 and pool.spares[0].capacity == "spot"  # a rank past the plan's
    pool.ensure(plan, 1)  # all alive: nothing new
    assert len(launched) == 3
    for asked, want in ((3, 3), (0, 0)):  # 0: the default
        pool, plan, launched = _pool(tmp_path / str(asked), monkeypatch, spot_spares=asked)
        pool.ensure(plan, 0)
        assert len(pool.spares) == want and sum(n.startswith("spare") for n, _, _ in launched) == want
    pool, plan, launched = _pool(tmp_path / "od", monkeypatch, capacity="on_demand")
    pool.ensure(plan, 0)
    assert pool.spares == [] and len(launched) == 2


def test_a_preempted_rank_gets_the_spare_at_once_and_a_new_spare_starts(tmp_path, monkeypatch):
    pool, plan, launched = _pool(tmp_path, monkeypatch)
    pool.ensure(plan, 0)
    spare = pool.spares[0]
    taken = pool._replace(1, plan, 0, capacity="spot")
    assert taken is spare and pool.workers[1] is spare and spare.rank == 1
    assert [n for n, _, _ in launched[3:]] == ["spare-w3"]  # the rank's new worker is the spare; a new spare starts
    assert [w.name for w in pool.spares] == ["spare-w3"]
    # a replacement on on-demand (a rank preempted too often) takes no spot spare
    on_demand = pool._replace(0, plan, 0, capacity="on_demand")
    assert on_demand.name == "r0-w4" and on_demand.capacity == "on_demand" and [w.name for w in pool.spares] == ["spare-w3"]


def test_a_spare_preempted_while_it_waits_is_billed_as_preempted_and_replaced(tmp_path, monkeypatch):
    pool, plan, launched = _pool(tmp_path, monkeypatch)
    pool.ensure(plan, 0)
    spare = pool.spares[0]
    left = time.time()
    pool.store.put(status_key(pool.ctx.run_id, spare.name),
                   json.dumps({"state": "preempted", "left_at": left, "noticed_at": left - 1}).encode())
    spare.launcher.outcomes[0].status, spare.launcher.outcomes[0].extra["exit_code"] = "failed", 6
    taken = pool._replace(1, plan, 0, capacity="spot")
    assert taken.name == "r1-w3" and pool.workers[1] is taken  # no spare ready: a new worker, as without one
    assert [w.name for w in pool.spares] == ["spare-w4"]  # and a new spare in the buried one's place
    rows = [r for r in pool.ctx.state.ledger if r.resource == f"worker {spare.name}"]
    assert [r.status for r in rows] == ["preempted"] and rows[0].stop == pytest.approx(left)


def _say(pool, worker, **status) -> None:
    """Write `worker`'s status as the worker would (`runtime.warm`)."""
    pool.store.put(status_key(pool.ctx.run_id, worker.name), json.dumps(status).encode())


def test_a_worker_idle_through_the_notice_serves_on_until_its_successor_is_ready_then_hands_over(
        tmp_path, monkeypatch):
    """Working through the notice between epochs: the pool starts a successor reserved for the
    rank (no job spares asked), keeps the noticed worker serving while it starts, and once the
    successor says it is ready stops the worker (released, billed as preempted to then) and gives
    the rank to the successor: no new worker, no spare left over."""
    pool, plan, launched = _pool(tmp_path, monkeypatch, spot_spares=0)
    pool.ensure(plan, 0)
    r1 = pool.workers[1]
    noticed = time.time()
    pool.epoch_began = {-2: noticed - 200, -1: noticed - 100}  # epochs of 100 s: the run outlasts the notice
    _say(pool, r1, state="idle", seq=1, epoch=0, noticed_at=noticed)
    pool.ensure(plan, 1)
    assert pool.workers[1] is r1 and r1.noticed_at == noticed and not r1.launcher.stopped  # it serves epoch 1
    [successor] = pool.spares
    assert successor.reserved_for == 1 and [n for n, _, _ in launched] == ["r0-w0", "r1-w1", "spare-w2"]
    pool.ensure(plan, 2)  # the successor has not said it is ready: the worker serves on, nothing new starts
    assert pool.workers[1] is r1 and len(launched) == 3 and pool.spares == [successor]
    _say(pool, successor, state="idle", seq=0, ready_at=time.time())
    successor.checked_at = 0.0  # its status is read at most every SUCCESSOR_CHECK_S
    pool.ensure(plan, 3)
    assert pool.workers[1] is successor and successor.rank == 1 and successor.reserved_for is None
    assert pool.spares == [] and len(launched) == 3 and r1.launcher.stopped
    assert pool.store.get(release_key(pool.ctx.run_id, r1.name)) is not None
    rows = [r for r in pool.ctx.state.ledger if r.resource == f"worker {r1.name}"]
    assert rows[-1].status == "preempted" and rows[-1].stop >= noticed


def test_a_worker_busy_through_the_notice_is_released_once_its_successor_is_ready(tmp_path, monkeypatch):
    """During an epoch the pool takes a live job spare as the noticed rank's successor (the job's
    spare count is made up at the pool's next start of workers), writes the worker's `release` once the successor is
    ready, and never gives one rank's successor to another rank."""
    from coordinator.workers.launchers import WorkerOutcome
    from coordinator.workers.warm_pool import Command

    pool, plan, launched = _pool(tmp_path, monkeypatch, spot_spares=1)
    pool.ensure(plan, 0)
    r0, spare = pool.workers[0], pool.spares[0]
    pool.epoch_began = {0: time.time() - 100}  # one epoch started: the pace is not known yet
    r0.command = Command(seq=0, spec=None, outcome=WorkerOutcome(rank=0, attempt=0, started_at=time.time()))
    r0.noticed_at = time.time()
    pool._work_through_notices(plan, 0)
    assert spare.reserved_for == 0 and len(launched) == 3  # the warm spare is its successor; none new yet
    released = release_key(pool.ctx.run_id, r0.name)
    with pytest.raises(KeyError):
        pool.store.get(released)  # not ready yet: the worker trains on
    _say(pool, spare, state="idle", seq=0, ready_at=time.time())
    pool._work_through_notices(plan, 0)
    assert r0.released and pool.store.get(released) is not None
    other = pool._replace(1, plan, 0, capacity="spot")  # rank 1 fails meanwhile: not rank 0's successor
    assert other is not spare and other.name == "r1-w3" and spare.reserved_for == 0
    taken = pool._replace(0, plan, 0, capacity="spot")  # rank 0 handed over: its successor takes it
    assert taken is spare and spare.rank == 0 and spare.reserved_for is None
    assert [w.name for w in pool.spares] == ["spare-w4"]  # and the job's one spare is started again


def test_no_successor_starts_where_the_run_ends_within_the_notices_working_time(tmp_path, monkeypatch):
    """Epochs of 10 s, 5 to go: the run ends 50 s on, within Fargate Spot's 90 s of work after the
    notice, so the worker works through it to the end and nothing is started; at 30 s an epoch
    (150 s to go) its rank needs a successor. Before the pace is measured, the plan's prediction."""
    pool, plan, launched = _pool(tmp_path, monkeypatch, spot_spares=0)
    pool.ensure(plan, 0)
    r1, now = pool.workers[1], time.time()
    pool.epoch_began = {-2: now - 20, -1: now - 10, 0: now}
    r1.noticed_at = now
    pool._work_through_notices(plan, 0)  # 5 epochs of the job's 5 left, this one whole: 50 s
    assert pool.spares == [] and len(launched) == 2
    pool.epoch_began = {-2: now - 60, -1: now - 30, 0: now}
    pool._work_through_notices(plan, 0)
    assert [w.reserved_for for w in pool.spares] == [1] and len(launched) == 3
    # before two epochs have started, the plan's predicted epoch is the pace: 5 epochs of 10 s end
    # within the notice, of 30 s they do not; with no prediction either, a successor starts
    for predicted, starts in ((10.0, False), (30.0, True), (0.0, True)):
        pool, plan, launched = _pool(tmp_path / f"p{predicted}", monkeypatch, spot_spares=0)
        plan.predicted_epoch_s = predicted
        pool.ensure(plan, 0)
        pool.epoch_began, pool.workers[1].noticed_at = {0: time.time()}, time.time()
        pool._work_through_notices(plan, 0)
        assert len(launched) == 2 + starts, predicted


def test_a_successor_is_launched_as_late_as_its_start_up_allows_and_not_at_all_if_the_run_ends_meanwhile(
        tmp_path, monkeypatch):
    """Start-ups of 20 and 25 s measured (the estimate: 25 s), Fargate Spot's 90 s of work after
    the notice: the successor is due once 35 s (start-up and `SUCCESSOR_MARGIN_S`) or less are left,
    judged again at each look, and the target's `startup_s` is a floor. A notice that came in the
    first epoch, before the pace was known, costs no successor where the pace measured meanwhile
    ends the run within the notice."""
    from coordinator.workers.warm_pool import SUCCESSOR_MARGIN_S

    pool, plan, launched = _pool(tmp_path, monkeypatch, spot_spares=0)
    pool.ensure(plan, 0)
    pool.ctx.state.startup_samples[:] = [20.0, 25.0]
    r1, now = pool.workers[1], time.time()
    pool.epoch_began = {-2: now - 200, -1: now - 100, 0: now}  # epochs of 100 s: the run outlasts the notice
    for since, due in ((0.0, False), (90.0 - 25.0 - SUCCESSOR_MARGIN_S - 5.0, False),
                       (90.0 - 25.0 - SUCCESSOR_MARGIN_S + 1.0, True)):
        r1.noticed_at = now - since
        pool._work_through_notices(plan, 0)
        assert len(launched) == 2 + due and [w.reserved_for for w in pool.spares] == [1] * due, since
    # the target's expected start-up, where longer than the run's, makes the successor due at once
    pool, plan, launched = _pool(tmp_path / "floor", monkeypatch, spot_spares=0, startup_s=80.0)
    pool.ensure(plan, 0)
    pool.ctx.state.startup_samples[:] = [20.0, 25.0]
    pool.epoch_began, pool.workers[1].noticed_at = {-2: now - 200, -1: now - 100, 0: now}, now
    pool._work_through_notices(plan, 0)
    assert len(launched) == 3
    # noticed during the first epoch (pace unknown: the run might outlast it), deferred, then the
    # pace seen by the time it would be due ends the run within the notice: no successor at all
    pool, plan, launched = _pool(tmp_path / "first", monkeypatch, spot_spares=0)
    pool.ensure(plan, 0)
    pool.ctx.state.startup_samples[:] = [20.0, 25.0]
    r1 = pool.workers[1]
    pool.epoch_began, r1.noticed_at = {0: now}, now
    pool._work_through_notices(plan, 0)
    assert len(launched) == 2  # not due yet
    r1.noticed_at = now - 60.0  # 30 s of its work left: due, but epochs of 5 s end the run 50 s on
    pool.epoch_began = {0: now - 10, 1: now - 5, 2: now}
    pool._work_through_notices(plan, 2)
    assert len(launched) == 2 and pool.spares == []


def test_a_worker_that_worked_through_its_notice_to_the_end_of_the_run_is_billed_as_preempted(
        tmp_path, monkeypatch):
    """The run ended before the successor took over (its notice came in the last epoch, not yet
    read): teardown reads the status, and the worker's last interval is a preemption (the rate the
    next plan prices counts it); its peer's is not."""
    pool, plan, launched = _pool(tmp_path, monkeypatch, spot_spares=0)
    pool.ensure(plan, 0)
    r0, r1 = pool.workers[0], pool.workers[1]
    _say(pool, r1, state="idle", seq=1, epoch=0, noticed_at=time.time())
    pool.stop_all("the run ended", grace_s=0.0)
    last = {w.name: [r for r in pool.ctx.state.ledger if r.resource == f"worker {w.name}"][-1] for w in (r0, r1)}
    assert last[r1.name].status == "preempted" and last[r0.name].status != "preempted"


def test_teardown_stops_the_spares_and_the_mid_run_ledger_bills_them(tmp_path, monkeypatch):
    pool, plan, launched = _pool(tmp_path, monkeypatch)
    pool.ensure(plan, 0)
    spare = pool.spares[0]
    rows = pool.open_rows(time.time() + 5)
    assert f"worker {spare.name}" in {r.resource for r in rows} and len(rows) == 3
    pool.stop_all("the run ended", grace_s=0.0)
    assert pool.spares == [] and spare.launcher.stopped
    assert any(r.resource == f"worker {spare.name}" for r in pool.ctx.state.ledger)


def test_spares_are_refused_on_on_demand_capacity_naming_the_field():
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import check_capacity, check_target_and_offer

    job = TrainJob(target="docker", capacity="on_demand", spot_spares=1)
    with pytest.raises(ZooidValueError) as refused:
        check_capacity(job, *check_target_and_offer(job))
    assert refused.value.field == "spot_spares" and "\n" not in str(refused.value)
    for capacity in ("spot", "auto"):
        job = TrainJob(target="docker", capacity=capacity, spot_spares=2)
        assert check_capacity(job, *check_target_and_offer(job)) is not None
    with pytest.raises(ValueError):
        TrainJob(spot_spares=-1)


def test_the_count_is_the_jobs_and_none_for_a_plan_sized_per_stage():
    from coordinator.run.job import TrainJob
    from coordinator.workers.preemptions import spot_spares

    one_size = SimpleNamespace(stage_memory_gb=())
    assert TrainJob().spot_spares == 0 and spot_spares(TrainJob(), one_size) == 0
    assert spot_spares(SimpleNamespace(spot_spares=2), one_size) == 2
    assert spot_spares(SimpleNamespace(spot_spares=3), SimpleNamespace(stage_memory_gb=(2.0, 4.0))) == 0

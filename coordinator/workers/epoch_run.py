"""One epoch on the target: the workers' specs, launched cold (a launcher per epoch, or the
workers pre-started during the previous one) or sent to the warm pool; failed attempts
classified and relaunched; every attempt's interval billed, from the provider's clock on a
container target; the workers' reports summarised.

Every attempt's interval goes to the ledger, including attempts that failed, so a retried
epoch is billed for what it really used. Before an attempt, the epoch's sync keys of an
earlier attempt are deleted, so no replica reads a dead attempt's slices.
"""
from __future__ import annotations

import dataclasses
import json
import time

from prefect.concurrency.sync import concurrency

from clouds.registry import adapter_for
from coordinator.bill.cloud_bill import cloud_records, replace_measured
from coordinator.bill.cost import worker_records
from coordinator.run.context import RunContext
from coordinator.workers.epoch_samples import check_samples
from coordinator.workers.failures import FailureKind, classify_failure
from coordinator.workers.epoch_keys import clear_epoch_keys
from coordinator.workers.launchers import (PAID_WORKERS_LIMIT, WorkerOutcome, WorkersFailed, make_launcher,
                                           worker_threads)
from coordinator.workers.preemptions import Preemptions, before_on_demand, mark_ledger, reached_step, redone_seconds
from coordinator.workers.warm_prestart import PrestartWatch, should_prestart, startup_report
from coordinator.workers.worker_specs import next_attempt, worker_specs
from core.epoch_summary import EpochSummary
from core.errors import DataError, OutOfMemory, ZooidValueError
from core.keys import worker_history_key
from core.kinds import Capacity, Strategy
from core.plan import Plan
from core.specs import WorkerSpec
from core.store_ops import grouped_json, grouped_total
from engine.chaos import read_fault_marker
from engine.preemption import read_preempted_marker


def bill_from_cloud_clock(ctx: RunContext, outcomes, epoch: int, plan: Plan | None = None) -> None:
    """On a container target (docker, ECS, ACI, Kubernetes), replace the coordinator's
    intervals with the provider's own start/stop times (collected every epoch: AWS forgets
    stopped tasks after about an hour). A resource of the run that no launcher knows and no
    ledger row names (a straggler the sweep will find) is billed too."""
    adapter = adapter_for(ctx.resolved.target)
    if adapter is None:
        return
    for o in outcomes:
        capacity = getattr(o, "extra", {}).get("capacity") or getattr(plan, "capacity", Capacity.ON_DEMAND)
        ctx.state.cloud_attempts[o.ref] = (epoch, o.rank, o.attempt, ctx.price_of(plan, capacity)(o.rank),
                                           str(capacity), ctx.price_of(plan, Capacity.ON_DEMAND)(o.rank))
    try:
        billed = {r.worker for r in ctx.state.ledger if r.worker}  # e.g. a profiling worker's own rows
        intervals = [i for i in adapter.intervals(ctx.run_id)
                     if i.flow_run_id in ctx.state.cloud_attempts or i.flow_run_id not in billed]
    except Exception as exc:  # the bill keeps the coordinator's intervals; say why
        print(f"zooid: cloud intervals unavailable, billing measured intervals: {exc}")
        return
    cloud_rows = cloud_records(ctx.run_id, intervals, ctx.state.cloud_attempts, ctx.resolved.offer,
                               ctx.price_per_worker_s, asked_to_stop=ctx.state.asked_to_stop)
    ctx.state.ledger[:] = replace_measured(ctx.state.ledger, cloud_rows)


def relaunch_policy(ctx: RunContext, plan: Plan, max_relaunches: int = 2, preemptions: Preemptions | None = None):
    """`on_failure` for the launcher: classify the failed attempt; relaunch that one worker
    (Local-SGD resumes it from the epoch's last sync checkpoint while the others wait at the
    sync) unless the failure cannot be retried (out of memory, bad input, unreadable data) or the worker
    already failed `max_relaunches` times. A pipeline stage has no mid-epoch resume: its
    failure fails the attempt, and the task's retry reruns the epoch.

    A preempted worker (`coordinator.workers.preemptions`) is counted in `preemptions`, never
    in `max_relaunches`: a Local-SGD replica over the store is relaunched at once (from its
    handover), on the capacity `preemptions` says; a pipeline stage or a ring's rank fails the
    attempt, which `run_epoch_on_target` reruns at once."""
    relaunched: dict[int, int] = {}
    preemptions = preemptions if preemptions is not None else Preemptions(before_on_demand(ctx.job))

    def on_failure(outcome, spec: WorkerSpec) -> WorkerSpec | None:
        store = ctx.open_store()
        try:
            marker = read_fault_marker(store, ctx.run_id, spec.epoch, spec.rank, spec.attempt)
            notice = read_preempted_marker(store, ctx.run_id, spec.epoch, spec.rank, spec.attempt)
        finally:
            store.close()
        notice = notice or outcome.extra.get("left_on_notice")  # a warm worker that left idle, before the epoch
        tail = _log_tail(outcome)
        failure = classify_failure(outcome.extra.get("exit_code"), tail,
                                   timed_out=outcome.status == "timeout", injected=marker, preempted=notice)
        outcome.extra["failure"] = failure.to_dict()
        if failure.kind is FailureKind.PREEMPTED:
            preemptions.record(spec.rank)
            outcome.extra.update(preempted=notice or {}, reached_step=reached_step(notice or marker))
            if plan.strategy != Strategy.LOCAL_SGD or spec.sync.collective == "ring":
                outcome.extra["rerun"] = True  # the whole attempt, at once (run_epoch_on_target)
                return None
            return preemptions.respec(dataclasses.replace(spec, attempt=next_attempt(ctx, spec.epoch, spec.rank)))
        if failure.kind is FailureKind.OOM:
            raise OutOfMemory(f"worker {spec.rank} of epoch {spec.epoch} ran out of memory "
                              f"({failure.reason}); re-plan with more memory per worker or a smaller batch")
        if failure.kind is FailureKind.BAD_INPUT:
            raise ZooidValueError("job", f"worker {spec.rank} refused its input: {failure.reason}")
        if failure.kind is FailureKind.DATA:
            raise DataError(f"worker {spec.rank} of epoch {spec.epoch} could not read its data ({failure.reason}); "
                            "not retried: prepare the dataset again")
        if (plan.strategy != Strategy.LOCAL_SGD or spec.sync.collective == "ring"  # a ring cannot take a new rank
                or relaunched.get(spec.rank, 0) >= max_relaunches):
            return None
        relaunched[spec.rank] = relaunched.get(spec.rank, 0) + 1
        return dataclasses.replace(spec, attempt=next_attempt(ctx, spec.epoch, spec.rank))

    return on_failure


def _log_tail(outcome) -> str:
    """The end of what the failed attempt printed (a warm worker's log from its epoch on)."""
    log = outcome.extra.get("log")
    if not log:
        return outcome.error or ""
    with open(log, errors="replace") as fh:
        fh.seek(outcome.extra.get("log_offset", 0))
        return (fh.read()[-4000:] + "\n" + (outcome.error or "")).strip()


def summarise(plan: Plan, epoch: int, lr: float, attempt: int, final: list[WorkerOutcome],
              tried: list[WorkerOutcome], wall_s: float, *, startup: dict, prestarted: bool,
              cost_usd: float) -> EpochSummary:
    """The epoch's row of the history from the workers' reports. In a pipeline every stage
    reports its replica's loss and samples, so only the first stages count; the worker that
    wrote the checkpoint (replica 0's last stage) reports validation. `tried`: every attempt
    of the epoch (the failed ones are its relaunches)."""
    results = [o.result for o in final]
    firsts = [r for r in results if r.rank % plan.stages == 0]
    samples = sum(r.samples for r in firsts)
    tokens = sum(r.tokens for r in firsts)
    loss = sum(r.train_loss * r.samples for r in firsts) / max(1, samples)
    rank0 = next(r for r in results if r.checkpoint_key) if plan.stages > 1 else \
        next(r for r in results if r.rank == 0)
    periods = [r.iteration_s or 0.0 for r in results]
    if all(p > 0 for p in periods):  # each worker's steady-state period: what the plan predicts
        per_step = max(periods)
    elif plan.stages > 1:  # too few iterations; a stage's compute_s is busy time, not its period
        per_step = max((r.stopped_at - r.started_at) / max(1, plan.steps_per_epoch) for r in results)
    else:
        per_step = max((r.compute_s + r.sync_s) / max(1, plan.steps_per_epoch) for r in results)
    return EpochSummary(
        epoch=epoch, workers=plan.workers, stages=plan.stages, attempt=attempt, lr=lr, train_loss=loss,
        val_loss=rank0.val_loss, val_accuracy=rank0.val_accuracy, val_perplexity=rank0.val_perplexity,
        val_token_accuracy=rank0.val_token_accuracy, samples=samples, tokens=tokens, seconds=wall_s,
        samples_per_s=samples / max(wall_s, 1e-9), tokens_per_s=tokens / max(wall_s, 1e-9), cost_usd=cost_usd,
        predicted_iteration_s=plan.predicted_iteration_s, measured_iteration_s=per_step,
        predicted_epoch_s=plan.predicted_epoch_s, bytes_synced=sum(r.bytes_synced for r in results),
        store_ops=grouped_json(grouped_total(r.store_ops for r in results)),
        checkpoint_key=rank0.checkpoint_key, compute_s=max(r.compute_s for r in results),
        sync_s=max(r.sync_s for r in results), critical_busy_s=max(r.compute_s + r.sync_s for r in results),
        prestarted=prestarted, startup=startup,
        relaunches=[{"rank": o.rank, "attempt": o.attempt, "status": o.status, "failure": o.extra.get("failure")}
                    for o in tried if o.status != "completed"],
        worker_pids={str(o.rank): o.result.pid for o in final if o.result})


def counted(ctx: RunContext, summary: EpochSummary) -> EpochSummary:
    """`summary`, its workers' store requests added to the run's (`RunState.store_ops`)."""
    ctx.state.store_ops = grouped_total([ctx.state.store_ops, summary.store_ops])
    return summary


def epoch_cost(ctx: RunContext, epoch: int) -> float:
    """What the ledger bills epoch `epoch` so far (every attempt)."""
    return sum(r.usd for r in ctx.state.ledger if r.epoch == epoch)


def epoch_specs(ctx: RunContext, plan: Plan, epoch: int, init: str, lr: float, attempt: int,
                resume: bool) -> list[WorkerSpec]:
    """The epoch's specs with fresh attempt numbers and the workers' thread count."""
    threads = worker_threads(ctx.resolved.target.kind, plan)
    return [dataclasses.replace(spec, attempt=next_attempt(ctx, epoch, spec.rank), resume=resume,
                                compute=dataclasses.replace(spec.compute, threads=threads))
            for spec in worker_specs(ctx, plan, epoch, init, lr, attempt)]


def warm_epoch(ctx: RunContext, plan: Plan, epoch: int, init: str, lr: float, resume: bool, attempt: int,
               on_tick=None, preemptions: Preemptions | None = None,
               seen: list[WorkerOutcome] | None = None) -> EpochSummary:
    """One epoch on the run's warm workers (started or retired to fit `plan` first)."""
    pool = ctx.state.warm
    started = pool.ensure(plan, epoch)
    sent = time.time()
    preemptions = preemptions if preemptions is not None else Preemptions(before_on_demand(ctx.job))
    specs = [preemptions.respec(s) for s in epoch_specs(ctx, plan, epoch, init, lr, attempt, resume)]
    try:
        final, attempts = pool.run_epoch(plan, specs, ctx.job.worker_timeout_s,
                                         relaunch_policy(ctx, plan, preemptions=preemptions), on_tick=on_tick)
    except WorkersFailed as exc:
        _seen(seen, exc.outcomes)
        raise
    _seen(seen, attempts)
    ended = max(o.stopped_at for o in final)
    first_work = [o.result.started_at for o in final if o.result]
    startup = {"mode": "warm", "cold_started": started, "exposed_s": max(0.0, max(first_work, default=sent) - sent)}
    ctx.state.last_epoch_s, ctx.state.last_epoch_end = max(0.05, ended - sent), ended
    bill_from_cloud_clock(ctx, [], epoch, plan)
    summary = summarise(plan, epoch, lr, attempt, final, attempts, ended - sent, startup=startup,
                        prestarted=False, cost_usd=epoch_cost(ctx, epoch))
    return counted(ctx, check_samples(ctx, plan, summary))


MAX_PREEMPTED_RERUNS = 8
"""The most times one epoch's attempt is rerun at once because a worker of it was preempted
(a pipeline stage, a ring's rank); past that, the task's own retries take over."""


def run_epoch_on_target(ctx: RunContext, plan: Plan, epoch: int, init: str, lr: float, resume: bool,
                        attempt: int, on_tick=None) -> EpochSummary:
    """One attempt at epoch `epoch` on the target (`attempt` > 0: the workers resume from the
    epoch's sync checkpoint), rerun at once while a preempted worker fails it (a pipeline
    stage, a ring's rank: `relaunch_policy`), with each rank on the capacity its preemptions
    leave it (`coordinator.workers.preemptions`). `resume`: the epoch had started under an
    earlier coordinator. `on_tick()` is called while the workers train (progress). Once the
    epoch is done its preempted attempts are marked in the ledger, with the work redone."""
    preemptions = Preemptions(before_on_demand(ctx.job))
    seen: list[WorkerOutcome] = []
    reruns = 0
    while True:
        try:
            summary = _run_attempt(ctx, plan, epoch, init, lr, resume, attempt, on_tick, preemptions, seen)
            break
        except WorkersFailed as exc:
            _seen(seen, exc.outcomes)
            if not any(o.extra.get("rerun") for o in exc.outcomes) or reruns >= MAX_PREEMPTED_RERUNS:
                _settle_preemptions(ctx, plan, epoch, seen)
                raise
            reruns += 1
            attempt += 1
            print(f"zooid: epoch {epoch}: a worker was preempted; attempt {attempt} now")
    _settle_preemptions(ctx, plan, epoch, seen)
    return dataclasses.replace(summary, cost_usd=epoch_cost(ctx, epoch))


def _seen(seen: list[WorkerOutcome] | None, outcomes) -> None:
    """Add `outcomes` to the epoch's attempts `seen` (each once)."""
    if seen is not None:
        seen.extend(o for o in outcomes if not any(o is s for s in seen))


def _settle_preemptions(ctx: RunContext, plan: Plan, epoch: int, seen: list[WorkerOutcome]) -> None:
    """Mark the epoch's preempted attempts in the ledger, the seconds each replacement redid
    (`coordinator.workers.preemptions`), and bill every attempt as the capacity it ran on."""
    preempted = [o for o in seen if (o.extra.get("failure") or {}).get("kind") == FailureKind.PREEMPTED.value]
    redone: dict[tuple[int, int], float] = {}
    if preempted:
        store = ctx.open_store()  # the workers' history records
        try:
            for o in preempted:
                ranks = sorted({p.rank for p in seen}) if o.extra.get("rerun") else [o.rank]
                for rank in ranks:
                    after = [p for p in seen if p.rank == rank and p is not o
                             and p.started_at >= (o.stopped_at or o.started_at)]
                    if not after:
                        continue
                    nxt = min(after, key=lambda p: p.started_at)
                    start, pace = _start_and_pace(store, ctx.run_id, epoch, nxt)
                    key = (rank, nxt.attempt)
                    redone[key] = redone.get(key, 0.0) + redone_seconds(o.extra.get("reached_step"), start, pace)
        finally:
            store.close()
    priced = {}
    for o in seen:
        capacity = o.extra.get("capacity")
        if capacity:
            priced[(o.rank, o.attempt)] = (ctx.offer_of(capacity).name, ctx.price_of(plan, capacity)(o.rank),
                                           capacity, ctx.price_of(plan, Capacity.ON_DEMAND)(o.rank))
    ctx.state.ledger[:] = mark_ledger(ctx.state.ledger, epoch, {(o.rank, o.attempt) for o in preempted},
                                      redone, priced, workers={o.extra["process_ref"] for o in preempted
                                                               if o.extra.get("process_ref")})


def _start_and_pace(store, run_id: str, epoch: int, outcome: WorkerOutcome) -> tuple[int, float]:
    """The step an attempt started from and its seconds per step: from its history record and
    result (a completed Local-SGD replica), its preempted marker (one preempted in turn), or
    step 0 at its result's pace (a pipeline stage, which always starts the epoch over)."""
    notice = outcome.extra.get("preempted") or {}
    if outcome.result is None:
        start, reached = int(notice.get("start_step", 0)), reached_step(notice)
        steps = (reached or 0) - start
        return start, (float(notice.get("trained_s", 0.0)) / steps if steps > 0 else 0.0)
    try:
        record = json.loads(store.get(worker_history_key(run_id, epoch, outcome.rank, outcome.attempt)))
    except KeyError:
        record = {}
    r = outcome.result
    trained = int(record.get("steps_trained") or 0)
    pace = r.iteration_s or ((r.compute_s + r.sync_s) / trained if trained else 0.0)
    return int(record.get("start_step", 0)), pace


def _run_attempt(ctx: RunContext, plan: Plan, epoch: int, init: str, lr: float, resume: bool, attempt: int,
                 on_tick, preemptions: Preemptions, seen: list[WorkerOutcome]) -> EpochSummary:
    """One attempt at the epoch (`run_epoch_on_target`)."""
    if ctx.job.warm:  # each warm worker holds its paid-worker slot from its start to its stop
        clear_epoch_keys(ctx, epoch, plan)
        return warm_epoch(ctx, plan, epoch, init, lr, resume, attempt, on_tick, preemptions, seen)
    launcher = ctx.state.prestarted.pop(epoch, None)  # started during the previous epoch
    if launcher is not None and (attempt > 0 or resume or any(o.status != "running" for o in launcher.outcomes)):
        launcher.stop("pre-started workers replaced")  # a retried epoch starts afresh
        ctx.state.launchers.remove(launcher)
        ctx.state.ledger.extend(worker_records(ctx.run_id, epoch, [o.to_dict() for o in launcher.outcomes],
                                         ctx.resolved.offer, ctx.price_of(plan)))
        launcher = None
    prestarted = launcher is not None
    if launcher is None:  # (pre-started workers' keys were cleared before they started: they may be syncing)
        clear_epoch_keys(ctx, epoch, plan)
        launcher = make_launcher(ctx, plan)
        ctx.state.launchers.append(launcher)
    # one slot of the global paid-worker limit per worker, held for the epoch (no-op when the
    # limit does not exist; `python -m deployments.bootstrap` creates it)
    with concurrency(PAID_WORKERS_LIMIT, occupy=plan.workers, timeout_seconds=ctx.job.worker_timeout_s,
                     strict=False):
        started = time.time()
        try:
            if not prestarted:
                for spec in epoch_specs(ctx, plan, epoch, init, lr, attempt, resume):
                    launcher.launch(preemptions.respec(spec))
            else:  # the epoch really starts when the previous one ended
                started = max(min(o.started_at for o in launcher.outcomes), ctx.state.last_epoch_end or 0.0)
            watch = PrestartWatch(ctx, plan, epoch, lr, started) if should_prestart(ctx, plan, epoch) else None
            ticks = [t for t in (watch.tick if watch else None, on_tick) if t is not None]
            final = launcher.wait(ctx.job.worker_timeout_s, relaunch_policy(ctx, plan, preemptions=preemptions),
                                  on_tick=(lambda: [t() for t in ticks]) if ticks else None)
        finally:
            launcher.stop("epoch over")
            ctx.state.launchers.remove(launcher)
            outcomes = launcher.outcomes
            _seen(seen, outcomes)
            ctx.state.ledger.extend(worker_records(ctx.run_id, epoch, [o.to_dict() for o in outcomes],
                                             ctx.resolved.offer, ctx.price_of(plan)))
            bill_from_cloud_clock(ctx, outcomes, epoch, plan)
    ended = max(o.stopped_at or started for o in outcomes)
    wall = ended - started
    startup = startup_report(final, ctx.state.last_epoch_end)
    ctx.state.startup_samples += [max(0.0, o.result.started_at - o.started_at) for o in final if o.result]
    # the next epoch's length is this one's training, not the start-up it exposed
    ctx.state.last_epoch_s = max(0.05, wall - startup.get("critical_exposed_s", 0.0))
    ctx.state.last_epoch_end = ended
    summary = summarise(plan, epoch, lr, attempt, final, outcomes, wall, startup=startup,
                        prestarted=prestarted, cost_usd=epoch_cost(ctx, epoch))
    return counted(ctx, check_samples(ctx, plan, summary))

"""The `train` flow: profile -> plan -> provision -> [run_epoch -> checkpoint -> rescale or
re-plan -> save_progress] x epochs -> teardown -> record_cost -> summary, each a step in `tasks/`.

After every epoch the planner is calibrated from what the workers measured
(`planners.calibration`); the next epoch runs the plan a rescale asked for, or else the
plan in force, unless a re-plan found one at least 10 % faster or cheaper (`coordinator.plan.planning.replan`).

`train(job)` takes a `TrainJob`; `train_with_params(**fields)` is the same flow with one
parameter per `TrainJob` field, which is what deployments run, so that
`prefect deployment run train/local --param workers=3` works and the UI shows a flat form.
From a shell: `python -m flows.train --param workers=2 --param epochs=3 [--summary-out PATH]`
(`flows.train_cli`: the command line, its signals and its temporary Prefect server).

The coordinator logs one line per epoch through the flow's logger (the UI's log and
`prefect deployment run --watch` show it). A run cancelled through Prefect ends `cancelled`
(summary.json, the report, the log's last line). A command line stopped by SIGTERM or Ctrl-C
tears the run down, bills it, prints three lines (torn down, bill, how to resume) and exits
143 or 130. In every end state the ledger is final before the report renders it.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not os.environ.get("PREFECT_API_URL") and "--help" not in sys.argv[1:]:
    # the command line's own Prefect server boots (about 7 s on a fresh home) while the imports
    # below (about 2 s) and the job's validation run; `flows.train_cli` stops it if the API is configured
    from deployments.server import TemporaryServer

    EARLY_SERVER: "TemporaryServer | None" = TemporaryServer()
else:
    EARLY_SERVER = None

import contextlib
import signal
import time
import uuid
from dataclasses import dataclass, field

from prefect import flow
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from coordinator.bill.cost import total_usd
from coordinator.bill.ledger import rows_now, store_ops_now
from coordinator.plan.planning import RunStores, expected_epoch_ops, idle_s, run_stores, strategy_inputs
from coordinator.plan.run_terms import RunClock, record_terms
from coordinator.plan.scaling_policy import forecast_workers
from coordinator.report.progress import epoch_line, money
from coordinator.report.report import epoch_table
from coordinator.run.context import ACTIVE, RunContext, run_id_for
from coordinator.run.job import RunSummary, TrainJob
from coordinator.run.outer_step import log_outer_settings
from coordinator.run.resume import ResumePoint
from coordinator.run.validate import check_target_ready, validate_job
from coordinator.workers.warm_pool import WarmPool, provisional_plan
from coordinator.workers.warm_prestart import WarmPrestart
from core.epoch_summary import EpochSummary, Replan
from core.fast_exit import exit_now
from core.keys import artifact_key, init_checkpoint_key
from core.plan import Plan
from core.store_ops import StoreOps
from flows.hooks import on_abnormal_end
from flows.params import job_fields_flow
from flows.train_cli import COMMAND_LINE, run_command_line
from planners.calibration import Calibration, epoch_overhead, fit
from tasks.checkpoint_step import checkpoint
from tasks.plan_step import choose_plan, reconsider_plan
from tasks.profile import profile
from tasks.progress_step import save_progress
from tasks.provision import provision
from tasks.record_cost import record_cost
from tasks.rescale import rescale
from tasks.resume_step import resume_point
from tasks.run_epoch import run_epoch
from tasks.summary_step import summarize
from tasks.teardown import teardown


_HOOKS = dict(on_failure=[on_abnormal_end], on_crashed=[on_abnormal_end], on_cancellation=[on_abnormal_end])


@flow(name="train", result_serializer="json", log_prints=True, **_HOOKS)
def train(job: TrainJob = TrainJob()) -> RunSummary:
    """Train `job` end to end and return its summary (also at runs/<run_id>/summary.json)."""
    return run_training(job)


def run_training(job: TrainJob) -> RunSummary:
    """The recipe; each step is a retried Prefect task (`tasks/`), or its call says why it runs in
    the flow."""
    restore = COMMAND_LINE.watch_sigterm()
    try:
        return _run_training(job)
    finally:
        restore()


train_with_params = job_fields_flow(run_training, name="train", result_serializer="json", log_prints=True,
                                    description="Train a model with Zooid (one parameter per TrainJob field).",
                                    **_HOOKS)


def _run_training(job: TrainJob) -> RunSummary:
    run = start_run(job)  # bad input or a target that cannot start a worker stops here: nothing billed
    try:
        profile_plan_and_provision(run)
        for epoch in range(run.first_epoch, job.epochs):
            COMMAND_LINE.raise_if_stopped()
            COMMAND_LINE.raise_if_cancelling(run.ctx.flow_run_id)
            if (stop := guardrail(job, run.ctx, run.plan, run.history)) is not None:
                run.status = stop
                break
            done = train_one_epoch(run, epoch)
            reached = target_reached(job, done)
            if not reached and epoch + 1 < job.epochs:
                rescale_or_replan(run, done)
            done.plan = run.plan.to_dict()
            save_progress(run.ctx, run.history)  # where a resume goes on
            if reached:
                run.status = "target_reached"
                break
    except BaseException as exc:
        run.status = end_state(exc, run.ctx)
        run.error = error_of(exc, run.status)
        raise
    finally:
        summary = finish_run(run)
    return summary


@dataclass
class Training:
    """What the recipe carries from step to step: the run, the plan in force (and the epoch it
    took over, whose predictions hold from there), the next epoch's inputs, the history."""

    ctx: RunContext
    resume: ResumePoint | None
    clock: RunClock
    progress_id: object = None
    profile: dict = field(default_factory=dict)
    plan: Plan | None = None
    plan_since: int = 0
    first_plan: dict = field(default_factory=dict)
    """The first plan, as the summary and the report show it."""
    first_epoch: int = 0
    init: str = ""
    lr: float = 0.0
    workers: int = 1
    calibration: Calibration = field(default_factory=Calibration)
    history: list[EpochSummary] = field(default_factory=list)
    stores: RunStores | None = None
    """The run's stores as its plans price them (their requests are measured against that)."""
    status: str = "failed"
    error: str | None = None

    @property
    def job(self) -> TrainJob:
        return self.ctx.job


def start_run(job: TrainJob) -> Training:
    """Validate the job and its target, name the run, find where a resumed run goes on, and
    start its progress artifact and warm pool."""
    from prefect.runtime import flow_run

    # validation runs in the flow, not a task: bad input is no transient failure for a retry to mend
    resolved = validate_job(job)  # bad input stops here: nothing provisioned, nothing billed
    check_target_ready(resolved)  # so does a target that is not set up or cannot start a worker
    fr_id = flow_run.id or uuid.uuid4().hex
    ctx = RunContext(run_id=job.resume or run_id_for(fr_id), job=job, resolved=resolved, flow_run_id=str(fr_id))
    resume = resume_point(ctx, required=job.resume is not None)
    ACTIVE[ctx.flow_run_id] = ctx
    COMMAND_LINE.started(ctx)
    run = Training(ctx=ctx, resume=resume, clock=RunClock(first_epoch_fresh=job.resume is None),
                   init=init_checkpoint_key(ctx.run_id), lr=job.lr, workers=job.workers)
    run.progress_id = ctx.state.progress_id = create_progress_artifact(0.0, description=f"Epochs of run {ctx.run_id}")
    ctx.state.warm = WarmPool(ctx) if job.warm else None
    return run


def profile_plan_and_provision(run: Training) -> None:
    """Profile on the target (warm workers' start-up hidden behind it where they start first),
    take over a resumed run's state, plan, and provision the run."""
    ctx, job, resume = run.ctx, run.job, run.resume
    # warm workers start in the flow, not a task: each holds its paid-worker slot for its life (`tasks.profile`)
    if ctx.state.warm is not None:  # their start-up hides behind profile + plan (on a shared host before them)
        ctx.state.warm.ensure(provisional_plan(ctx), resume.next_epoch if resume else 0)
    run.profile = ctx.state.profile = profile(ctx)
    run.clock.profiled = "measured" in run.profile.get("profile_sources", {}).values()
    if resume is not None:
        run.first_epoch, run.init, run.lr, run.workers = resume.next_epoch, resume.init_key, resume.lr, resume.workers
        run.history, ctx.state.ledger = list(resume.history), list(resume.ledger) + ctx.state.ledger  # + profiling
        for rank in range(job.max_workers):  # attempt numbers stay unique across coordinators
            ctx.state.attempts[(run.first_epoch, rank)] = resume.max_attempt
    last_replan = run.history[-1].replan if run.history else None
    run.calibration = Calibration.from_dict(last_replan.calibration if last_replan else None)
    if resume is not None and resume.plan and resume.plan.get("data_parallel") == run.workers:
        run.plan = Plan.from_dict(resume.plan)  # the same plan, so a started epoch can go on
    else:
        run.plan = choose_plan(ctx, run.profile, run.workers, run.calibration, job.epochs - run.first_epoch)
    run.plan_since, run.first_plan = run.first_epoch, run.plan.to_dict()
    log_outer_settings(job, run.plan.steps_per_epoch)  # what the sync period chose, or a warning
    run.clock.planned_at = run.first_plan["planned_at"] = time.time()  # its run prediction counts from here
    run.stores = run_stores(ctx)
    run.clock.plan_made(ctx, run.stores, idle_s(ctx), resumed=resume is not None)  # own requests counted from here
    if ctx.state.warm is not None:  # start-up overlaps provisioning
        ctx.state.warm.ensure(run.plan, run.first_epoch)
    provision(ctx, run.plan, fresh=resume is None)
    run.status = "completed"


def train_one_epoch(run: Training, epoch: int) -> EpochSummary:
    """Run the epoch (the next epoch's warm workers pre-started behind it where the policy
    knows their count), commit its checkpoint, calibrate the planner from it, record it."""
    ctx, job = run.ctx, run.job
    resuming = run.resume is not None and run.resume.mid_epoch and epoch == run.first_epoch
    ticks = [COMMAND_LINE.raise_if_stopped, epoch_progress_tick(ctx, run.progress_id, len(run.history))]
    if ctx.state.warm is not None and epoch + 1 < job.epochs and \
            (upcoming := forecast_workers(ctx, run.profile, run.history, run.plan.data_parallel, run.lr)):
        ticks.append(WarmPrestart(ctx, run.plan, epoch, upcoming).tick)  # hides the next start-up
    sent, requested = time.time(), store_ops_now(ctx)
    waited = sent - (run.clock.epochs[-1][1] if run.clock.epochs else run.clock.idle_since or sent)
    summary = run_epoch(ctx, run.plan, epoch, run.init, run.lr, resuming, on_tick=lambda: [t() for t in ticks])
    done = time.time()
    run.clock.epoch(sent, done)
    run.clock.epoch_ops.append((requested, expected_epoch_ops(ctx, run.plan, done - sent, run.stores, waited),
                                run.stores.protocol_role(run.plan)))
    if epoch == run.first_epoch and run.plan.predicted_first_epoch_s:  # start-up and warm-up in force
        summary.predicted_epoch_s = run.plan.predicted_first_epoch_s
    summary.predicted_cost_so_far_usd = predicted_cost_at(run.plan, epoch - run.plan_since)
    run.init = checkpoint(ctx, summary)
    # calibrated in the flow, not a task: arithmetic on the epoch just measured, nothing to retry
    run.calibration = fit(run.plan, summary, run.calibration, first=epoch == run.first_epoch,
                          inputs=strategy_inputs(ctx, run.profile, run.workers))
    summary.overhead_s = epoch_overhead(run.plan, summary)
    run.history.append(summary)
    # in the flow, not a task: the UI's progress, the epoch's line in the flow run's own log; nothing to retry
    _epoch_progress(ctx, run.progress_id, run.history, run.first_plan.get("predicted_run_cost_usd"))
    return summary


def rescale_or_replan(run: Training, summary: EpochSummary) -> None:
    """The scaling policy's worker budget for the next epoch; planned anew when it moved, else
    the plan in force re-predicted from the calibration and replaced when another is clearly
    better. Both decisions go into the epoch's record."""
    ctx, left = run.ctx, run.job.epochs - summary.epoch - 1
    summary.rescale = decision = rescale(ctx, run.profile, run.history, run.workers, run.lr)
    run.lr = decision.lr
    if decision.workers != run.workers:  # the policy moved the worker budget
        run.workers = decision.workers
        run.plan = choose_plan(ctx, run.profile, run.workers, run.calibration, left)
        summary.replan = Replan(calibration=run.calibration.to_dict(), switched=True,
                                reason=f"rescaled to {run.workers} worker(s) by the {run.job.scaling} policy",
                                predicted_epoch_s=run.plan.predicted_epoch_s)
    else:
        run.plan, summary.replan = reconsider_plan(ctx, run.profile, run.plan, run.calibration, left, run.workers)
    run.plan_since = summary.epoch + 1  # the plan (re-)predicted now holds from the next epoch


def finish_run(run: Training) -> RunSummary:
    """Tear down, record the final bill (before the report renders it), write the summary and
    the run's terms for the next plan on this target; a cancelled run says so last."""
    ctx = run.ctx
    run.clock.teardown_at = time.time()
    live = COMMAND_LINE.live_workers(ctx)  # before the teardown: its last lines say what it stopped
    teardown(ctx)
    writes_after = 1 + bool(run.history)  # the summary's put and its curves', after the final ledger's
    if run.stores is not None:  # the run's requests, those three puts included
        run.clock.ops_at_end = store_ops_now(ctx, {run.stores.durable_where: StoreOps(put=1 + writes_after)})
    # the next plan on this target predicts from them (before the final ledger, which bills their
    # requests); in the flow, not a task: best effort, it never raises
    record_terms(ctx, run.clock, run.history)
    # final before the report renders it; nothing rewrites it
    ledger = record_cost(ctx, writes_after=writes_after)
    summary = summarize(ctx, run.status, run.history, run.first_plan, ledger, run.error)
    ACTIVE.pop(ctx.flow_run_id, None)
    COMMAND_LINE.ended(ctx, live, ledger["total_usd"])
    if run.status == "cancelled":
        with contextlib.suppress(Exception):  # the run's own end goes on whatever happens here
            _log_cancelled(ctx, ledger)
    return summary


def guardrail(job: TrainJob, ctx: RunContext, plan: Plan, history: list[EpochSummary]) -> str | None:
    """`budget_exhausted` / `deadline_reached` when the next epoch would pass the limit, judged
    by the larger of the plan's prediction and the last measured epoch."""
    last = history[-1] if history else None
    next_s = max(plan.predicted_epoch_s, last.seconds if last else 0.0)
    next_usd = max(plan.predicted_cost_per_epoch_usd, last.cost_usd if last else 0.0)
    spent = sum(r.usd for r in ctx.state.ledger) + (time.time() - ctx.started_at) * ctx.price_per_coordinator_s
    if job.budget_usd is not None and spent + next_usd > job.budget_usd:
        return "budget_exhausted"
    if job.deadline_s is not None and (time.time() - ctx.started_at) + next_s > job.deadline_s:
        return "deadline_reached"
    return None


def target_reached(job: TrainJob, epoch: EpochSummary) -> bool:
    acc, loss = epoch.val_accuracy, epoch.val_loss
    return ((job.target_accuracy is not None and acc is not None and acc >= job.target_accuracy)
            or (job.target_loss is not None and loss is not None and loss <= job.target_loss))


def epoch_progress_tick(ctx: RunContext, progress_id, done: int, every_s: float = 5.0):
    """A callback that moves the progress artifact within an epoch, by the steps the warm
    workers reported, at most every `every_s` seconds."""
    last = [time.time()]

    def tick() -> None:
        if progress_id is None or ctx.state.warm is None or time.time() - last[0] < every_s:
            return
        last[0] = time.time()
        steps, total = ctx.state.warm.progress()
        if total:
            update_progress_artifact(progress_id, 100.0 * (done + steps / total) / ctx.job.epochs)

    return tick


def predicted_cost_at(plan: Plan, index: int) -> float | None:
    """The bill `plan` predicted at the end of its `index`-th epoch (None: not predicted)."""
    by_epoch = plan.predicted_cost_by_epoch_usd
    return by_epoch[index] if 0 <= index < len(by_epoch) else None


def _epoch_progress(ctx: RunContext, progress_id, history: list[EpochSummary],
                    predicted_run_cost_usd: float | None) -> None:
    log_epoch(ctx, history[-1], predicted_run_cost_usd)
    if progress_id is not None:
        update_progress_artifact(progress_id, 100.0 * len(history) / ctx.job.epochs)
    create_table_artifact(key=artifact_key(ctx.run_id, "epochs"), table=epoch_table(history),
                          description=f"Per-epoch history of run {ctx.run_id}")


def log_epoch(ctx: RunContext, epoch: EpochSummary, predicted_run_cost_usd: float | None = None) -> str:
    """The coordinator's line for a finished epoch, through the flow's logger (so the UI's log
    and `prefect deployment run --watch` show it): epoch i/N, workers, loss, accuracy, seconds
    against predicted, the bill so far against the run's prediction."""
    from prefect.logging import get_run_logger

    line = epoch_line(epoch, ctx.job.epochs, total_usd(rows_now(ctx)), predicted_run_cost_usd)
    try:
        get_run_logger().info(line)
    except Exception:  # a progress line never stops a run
        pass
    return line


def end_state(exc: BaseException, ctx: RunContext) -> str:
    """`cancelled` when `exc` is how a cancellation reached the flow: a command line stopped by
    its user (SIGTERM or Ctrl-C, noted by `COMMAND_LINE`), or Prefect's runner asking with the
    `cancel` intent, then sending SIGTERM, which Prefect raises as `TerminationSignal` (or the
    flow run already set Cancelling when the signal came); else `failed`."""
    from prefect.exceptions import TerminationSignal

    if COMMAND_LINE.active:
        return "cancelled" if COMMAND_LINE.signal is not None else "failed"
    if not isinstance(exc, TerminationSignal):
        return "failed"
    try:
        from prefect._internal.control_listener import get_intent

        if get_intent() == "cancel":
            return "cancelled"
    except ImportError:
        pass
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(ctx.flow_run_id).state
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            return "cancelled"
    except Exception:  # no API, or not a flow run it knows
        pass
    return "failed"


def error_of(exc: BaseException, status: str) -> str:
    """What stopped the run (`status`: its end state), in the words the summary gives."""
    if COMMAND_LINE.active and COMMAND_LINE.signal is not None:
        return f"interrupted by {signal.Signals(COMMAND_LINE.signal).name} on the command line"
    if status == "cancelled":
        return "cancelled through Prefect (UI or API)"
    return f"{type(exc).__name__}: {exc}"


def _log_cancelled(ctx: RunContext, ledger: dict) -> None:
    """The cancelled run's last lines: what it left and cost, and the flow run's state set to
    Cancelled here too, so the engine's closing "Finished in state ..." line says Cancelled
    (a runner that owns the cancellation sets it on the server; the engine's copy would still
    read Running)."""
    from prefect.context import FlowRunContext
    from prefect.logging import get_run_logger
    from prefect.states import Cancelled

    message = f"run {ctx.run_id} cancelled: its workers were stopped, bill {money(ledger['total_usd'])}"
    get_run_logger().info(f"zooid {message}; resume with --param resume={ctx.run_id}")
    flow_ctx = FlowRunContext.get()
    if flow_ctx is not None and flow_ctx.flow_run is not None:
        current = flow_ctx.flow_run.state
        if current is None or not current.is_final():
            flow_ctx.flow_run.state = Cancelled(message=message)


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.train --param name=value ... [--summary-out PATH]`: the command line
    (`flows.train_cli`) running this flow, with the server started before the imports."""
    return run_command_line(train, argv, early=EARLY_SERVER, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    exit_now(main())

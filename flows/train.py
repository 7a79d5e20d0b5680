"""The `train` flow: profile -> plan -> provision -> [run_epoch -> checkpoint -> rescale or
re-plan] x epochs -> teardown -> record_cost.

After every epoch the planner is calibrated from what the workers measured
(`planners.calibration`); the next epoch runs the plan a rescale asked for, or else the
plan in force, unless a re-plan found one at least 10 % faster or cheaper (`coordinator.plan.planning.replan`).

`train(job)` takes a `TrainJob`; `train_with_params(**fields)` is the same flow with one
parameter per `TrainJob` field, which is what deployments run, so that
`prefect deployment run train/local --param workers=3` works and the UI shows a flat form.
From a shell: `python -m flows.train --param workers=2 --param epochs=3 [--summary-out PATH]`.

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
    # below (about 2 s) and the job's validation run; `main` stops it if the API is configured
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
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from blocks.store_refs import open_store_ref
from coordinator.bill.cost import read_ledger, total_usd, worker_seconds
from coordinator.bill.ledger import record_cost_now, rows_now
from coordinator.plan.planning import strategy_inputs
from coordinator.plan.run_terms import RunClock, record_terms
from coordinator.plan.scaling_policy import forecast_workers
from coordinator.report.progress import epoch_line, interrupted_lines, money
from coordinator.report.report import epoch_table, markdown_report, plot_curves, text_report
from coordinator.run.context import ACTIVE, RunContext, run_id_for
from coordinator.run.job import RunSummary, TrainJob
from coordinator.run.job_fields import check_fields, fields_from_args
from coordinator.run.outer_step import log_outer_settings
from coordinator.run.resume import ResumePoint, find_resume_point, write_history
from coordinator.run.validate import check_target_ready, validate_job
from coordinator.workers.sweep import worker_pids
from coordinator.workers.warm_pool import WarmPool, provisional_plan
from coordinator.workers.warm_prestart import WarmPrestart
from core.epoch_summary import EpochSummary, Replan, run_token_figures
from core.errors import ZooidValueError
from core.fast_exit import exit_now
from core.keys import artifact_key, init_checkpoint_key, ledger_key, report_key, summary_key
from core.plan import Plan
from deployments.bootstrap import PAID_WORKERS, ensure_concurrency_limit
from deployments.server import TemporaryServer, drain_prefect_clients, temporary_server
from engine.optimizers import load_lazy_modules
from flows.hooks import on_abnormal_end
from flows.params import job_fields_flow
from planners.calibration import Calibration, epoch_overhead, fit
from tasks.checkpoint_step import checkpoint
from tasks.plan_step import choose_plan, reconsider_plan
from tasks.profile import profile
from tasks.provision import provision
from tasks.record_cost import record_cost
from tasks.rescale import rescale
from tasks.run_epoch import run_epoch
from tasks.teardown import teardown


def guardrail(job: TrainJob, ctx: RunContext, plan: Plan, history: list[EpochSummary]) -> str | None:
    """`budget_exhausted` / `deadline_reached` when the next epoch would pass the limit, judged
    by the larger of the plan's prediction and the last measured epoch."""
    last = history[-1] if history else None
    next_s = max(plan.predicted_epoch_s, last.seconds if last else 0.0)
    next_usd = max(plan.predicted_cost_per_epoch_usd, last.cost_usd if last else 0.0)
    spent = sum(r.usd for r in ctx.state.ledger) + (time.time() - ctx.started_at) * ctx.price_per_worker_s
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


def _finish(ctx: RunContext, status: str, history: list[EpochSummary], plan: dict, ledger: dict,
            error: str | None) -> RunSummary:
    last = history[-1] if history else None
    summary = RunSummary(
        run_id=ctx.run_id, status=status, final_loss=last.loss if last else None,
        final_accuracy=last.val_accuracy if last else None, total_cost_usd=ledger["total_usd"], plan=plan,
        epochs=history, store_url=ctx.durable_ref, checkpoint_key=last.checkpoint_key if last else "", error=error,
        worker_seconds=worker_seconds(ledger["rows"]), final_perplexity=last.val_perplexity if last else None,
        final_token_accuracy=last.val_token_accuracy if last else None,
        **run_token_figures(history, ledger["total_usd"]))
    png = plot_curves(summary.epochs) if summary.epochs else None
    store = ctx.open_durable()
    try:
        store.put(summary_key(ctx.run_id), summary.model_dump_json(indent=1).encode())
        if png:
            store.put(report_key(ctx.run_id, "curves.png"), png)
    finally:
        store.close()
    create_markdown_artifact(key=artifact_key(ctx.run_id, "report"),
                             markdown=markdown_report(summary, ledger["rows"], png),
                             description=f"Plan, epochs and bill of run {ctx.run_id}")
    return summary


def run_training(job: TrainJob) -> RunSummary:
    """The recipe; each step is a retried Prefect task."""
    restore = COMMAND_LINE.watch_sigterm()
    try:
        return _run_training(job)
    finally:
        restore()


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
    status: str = "failed"
    error: str | None = None

    @property
    def job(self) -> TrainJob:
        return self.ctx.job


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
            if target_reached(job, done):
                run.status = "target_reached"
                break
            if epoch + 1 < job.epochs:
                rescale_or_replan(run, done)
            done.plan = run.plan.to_dict()
            save_progress(run.ctx, run.history)
    except BaseException as exc:
        run.status = end_state(exc, run.ctx)
        run.error = error_of(exc, run.status)
        raise
    finally:
        summary = finish_run(run)
    return summary


def start_run(job: TrainJob) -> Training:
    """Validate the job and its target, name the run, find where a resumed run goes on, and
    start its progress artifact and warm pool."""
    from prefect.runtime import flow_run

    resolved = validate_job(job)  # bad input stops here: nothing provisioned, nothing billed
    check_target_ready(resolved)  # so does a target that is not set up or cannot start a worker
    fr_id = flow_run.id or uuid.uuid4().hex
    ctx = RunContext(run_id=job.resume or run_id_for(fr_id), job=job, resolved=resolved, flow_run_id=str(fr_id))
    resume = find_resume_point(ctx, required=job.resume is not None)
    ACTIVE[ctx.flow_run_id] = ctx
    COMMAND_LINE.run = {"run_id": ctx.run_id, "flow_run_id": ctx.flow_run_id}
    run = Training(ctx=ctx, resume=resume, clock=RunClock(first_epoch_fresh=job.resume is None),
                   init=init_checkpoint_key(ctx.run_id), lr=job.lr, workers=job.workers)
    run.progress_id = ctx.state.progress_id = create_progress_artifact(0.0, description=f"Epochs of run {ctx.run_id}")
    ctx.state.warm = WarmPool(ctx) if job.warm else None
    return run


def profile_plan_and_provision(run: Training) -> None:
    """Profile on the target (warm workers' start-up hidden behind it where they start first),
    take over a resumed run's state, plan, and provision the run."""
    ctx, job, resume = run.ctx, run.job, run.resume
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
    sent = time.time()
    summary = run_epoch(ctx, run.plan, epoch, run.init, run.lr, resuming, on_tick=lambda: [t() for t in ticks])
    run.clock.epoch(sent, time.time())
    if epoch == run.first_epoch and run.plan.predicted_first_epoch_s:  # start-up and warm-up in force
        summary.predicted_epoch_s = run.plan.predicted_first_epoch_s
    summary.predicted_cost_so_far_usd = predicted_cost_at(run.plan, epoch - run.plan_since)
    run.init = checkpoint(ctx, summary)
    run.calibration = fit(run.plan, summary, run.calibration, first=epoch == run.first_epoch,
                          inputs=strategy_inputs(ctx, run.profile, run.workers))
    summary.overhead_s = epoch_overhead(run.plan, summary)
    run.history.append(summary)
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


def error_of(exc: BaseException, status: str) -> str:
    """What stopped the run (`status`: its end state), in the words the summary gives."""
    if COMMAND_LINE.active and COMMAND_LINE.signal is not None:
        return f"interrupted by {signal.Signals(COMMAND_LINE.signal).name} on the command line"
    if status == "cancelled":
        return "cancelled through Prefect (UI or API)"
    return f"{type(exc).__name__}: {exc}"


def finish_run(run: Training) -> RunSummary:
    """Tear down, record the final bill (before the report renders it), write the summary and
    the run's terms for the next plan on this target; a cancelled run says so last."""
    ctx = run.ctx
    run.clock.teardown_at = time.time()
    live = _live_workers(ctx)
    teardown(ctx)
    ledger = record_cost(ctx)  # final before the report renders it; nothing rewrites it
    summary = _finish(ctx, run.status, run.history, run.first_plan, ledger, run.error)
    record_terms(ctx, run.clock, run.history)  # the next plan on this target predicts from them
    ACTIVE.pop(ctx.flow_run_id, None)
    COMMAND_LINE.run.update(workers=live, bill_usd=ledger["total_usd"], ledger_at=_ledger_at(ctx))
    if run.status == "cancelled":
        with contextlib.suppress(Exception):  # the run's own end goes on whatever happens here
            _log_cancelled(ctx, ledger)
    return summary


def _live_workers(ctx: RunContext) -> int:
    """Worker processes or flow runs of the run still alive before its teardown."""
    try:
        return len(worker_pids(ctx.run_id)) or len(ctx.state.warm.workers if ctx.state.warm is not None else [])
    except Exception:
        return 0


def _ledger_at(ctx: RunContext) -> str:
    """Where the run's ledger is, as a path for a directory store."""
    ref = ctx.durable_ref
    if ref.startswith("file://"):
        return f"{ref.removeprefix('file://').rstrip('/')}/{ledger_key(ctx.run_id)}"
    return f"{ref} {ledger_key(ctx.run_id)}"


def _ledger_of(summary: RunSummary) -> dict | None:
    """The ledger the run wrote beside its summary (the report's wall time and infrastructure)."""
    try:
        store = open_store_ref(summary.store_url)
        try:
            return read_ledger(store, summary.run_id)
        finally:
            store.close()
    except Exception:  # the report without it still says what ran
        return None


def save_progress(ctx: RunContext, history: list[EpochSummary]) -> None:
    """History and the bill so far, so a killed coordinator leaves both behind."""
    store = ctx.open_durable()
    try:
        write_history(store, ctx.run_id, history)
    finally:
        store.close()
    record_cost_now(ctx, final=False)


def _quiet_console() -> None:
    """Nothing more reaches the terminal from loggers (Prefect's console handler, prints the
    flow logs) or warnings; the API's log handler still gets every line for the UI."""
    import logging
    import warnings

    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in streams:
                handler.setLevel(logging.CRITICAL + 1)
    warnings.simplefilter("ignore")


class CommandLine:
    """A `python -m flows.train` run (`active`): the signal that stopped it and what its run
    left (`run`: run id, workers alive at teardown, bill, ledger), for `main`'s last lines.

    The first SIGTERM or SIGINT quiets the console, then stops the flow as before (Prefect's
    SIGTERM handler raises `TerminationSignal`, SIGINT `KeyboardInterrupt`), so the teardown
    and the bill run without a screen of crash reports; a later signal is ignored, so a second
    Ctrl-C does not cut the teardown short."""

    def __init__(self) -> None:
        self.active = False
        self.signal: int | None = None
        self.run: dict = {}
        self.cancel_checked_at = 0.0

    def reset(self, active: bool) -> None:
        self.active, self.signal, self.run = active, None, {}
        self.cancel_checked_at = time.monotonic()

    def stop(self, signum: int) -> bool:
        """Note the first stop signal and quiet the console; False for a later one."""
        if self.signal is not None:
            return False
        self.signal = signum
        _quiet_console()
        return True

    def raise_if_stopped(self) -> None:
        """Raise for a stop signal already noted. The exception the signal raised can land in
        library code that catches it: the recipe's next boundary, and the epoch's every poll,
        raise it again."""
        if self.active and self.signal is not None:
            raise KeyboardInterrupt(f"signal {self.signal}")

    def raise_if_cancelling(self, flow_run_id: str, every_s: float = 2.0) -> None:
        """At most every `every_s`: a command line's flow run that Prefect set Cancelling (its own
        SIGTERM handler does, when the signal reaches it instead of ours) stops as if the signal
        had been noted. A command line once trained on for minutes after its SIGTERM, its flow
        run Cancelling on the server."""
        now = time.monotonic()
        if not self.active or now - self.cancel_checked_at < every_s:
            return
        self.cancel_checked_at = now
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run_id).state
        except Exception:  # the API's trouble is not a stop
            return
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            self.stop(signal.SIGTERM)
            self.raise_if_stopped()

    def watch_sigterm(self):
        """Inside the flow (where Prefect's engine owns SIGTERM), on a command line: chain a
        handler that notes the signal before Prefect's raises. Returns the undo."""
        if not self.active:
            return lambda: None
        try:
            inner = signal.getsignal(signal.SIGTERM)
        except ValueError:  # not the main thread
            return lambda: None

        def on_sigterm(signum, frame):
            if not self.stop(signum):
                return
            if callable(inner):
                inner(signum, frame)
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, on_sigterm)
        return lambda: signal.signal(signal.SIGTERM, inner)


COMMAND_LINE = CommandLine()


_HOOKS = dict(on_failure=[on_abnormal_end], on_crashed=[on_abnormal_end], on_cancellation=[on_abnormal_end])


@flow(name="train", result_serializer="json", log_prints=True, **_HOOKS)
def train(job: TrainJob = TrainJob()) -> RunSummary:
    """Train `job` end to end and return its summary (also at runs/<run_id>/summary.json)."""
    return run_training(job)


train_with_params = job_fields_flow(run_training, name="train", result_serializer="json", log_prints=True,
                                    description="Train a model with Zooid (one parameter per TrainJob field).",
                                    **_HOOKS)


@contextlib.contextmanager
def prefect_api(server=None):
    """The Prefect API for a command-line run: the configured one, or a temporary server of
    our own that outlives a Ctrl-C (`deployments.server.temporary_server`, with the paid-workers
    limit a bootstrapped API has). SIGTERM and SIGINT are noted (`COMMAND_LINE`: the console
    goes quiet) and raised as KeyboardInterrupt (inside the flow, Prefect's TerminationSignal),
    so either one runs the flow's teardown and bill before exiting."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    def interrupt(signum, frame):
        if COMMAND_LINE.stop(signum):
            raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    previous_int = signal.signal(signal.SIGINT, interrupt)
    try:
        if PREFECT_API_URL.value():
            yield
            return

        # The temporary server lives and dies with this command: no one is left to tell a crashed
        # flow run by its heartbeats, and Prefect's heartbeat thread, which sleeps in whole
        # seconds, held the end of every command by up to 1 s (0.66 s measured) while it joined.
        with temporary_server(started=server) as url, \
                temporary_settings(updates={PREFECT_API_URL: url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            _ensure_paid_workers_limit()
            try:
                yield
            finally:  # the run's logs and events reach the server before it stops
                drain_prefect_clients()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _ensure_paid_workers_limit() -> None:
    """The paid-workers limit the flows take slots of, on a temporary server as on a
    bootstrapped one (else Prefect warns that it does not exist at every launch)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            ensure_concurrency_limit(client, PAID_WORKERS)
    except Exception:  # only a warning is at stake
        pass


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.train --param name=value ... [--summary-out PATH]`. The temporary Prefect
    server it starts (before its imports, `EARLY_SERVER`, or for the run) is stopped however it
    ends."""
    import argparse

    server = None
    try:
        parser = argparse.ArgumentParser(prog="python -m flows.train", description=__doc__.splitlines()[0])
        parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                            help="a TrainJob field, e.g. workers=4 (repeat)")
        parser.add_argument("--summary-out", metavar="PATH", help="also write the summary JSON here")
        args = parser.parse_args(argv)
        try:
            fields = fields_from_args(args.param)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        fields.setdefault("target", "inline")
        server = early_server()  # its start-up overlaps the job's validation
        return _validated_run(args, fields, server)
    finally:
        for started in (server, EARLY_SERVER):
            if started is not None:
                started.stop()  # (idempotent: a no-op once the run's own teardown stopped it)


def early_server():
    """The command line's temporary Prefect server when no API is configured: the one started
    before the imports (`EARLY_SERVER`, under `python -m flows.train`), else one started now."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # configured in a Prefect profile: `main` stops the early one unused
        return None
    if EARLY_SERVER is not None and EARLY_SERVER.pid is not None:
        return EARLY_SERVER

    return TemporaryServer()


def _validated_run(args, fields: dict, server) -> int:
    try:
        job = check_fields(fields)  # what `make run` checks before it starts its stack
    except ZooidValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if server is not None:  # while the server boots: staging's first optimizer would load them (0.6 s)
        load_lazy_modules()
    COMMAND_LINE.reset(active=True)
    try:
        with prefect_api(server):
            try:
                summary = train(job)
            except BaseException:
                if COMMAND_LINE.signal is not None:
                    _set_cancelled(COMMAND_LINE.run.get("flow_run_id"))
                raise
    except BaseException as exc:
        if COMMAND_LINE.signal is not None or isinstance(exc, KeyboardInterrupt):
            return _interrupted(args.param)
        if isinstance(exc, ZooidValueError):  # found once measured, e.g. a stage that does not fit memory
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if not isinstance(exc, Exception):
            raise
        print(f"error: run failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return 1
    finally:
        COMMAND_LINE.active = False
    print(text_report(summary, _ledger_of(summary)))
    if args.summary_out:
        with open(args.summary_out, "w") as fh:
            fh.write(summary.model_dump_json(indent=1))
    return 0 if summary.status != "failed" else 1


def _set_cancelled(flow_run_id: str | None) -> None:
    """The flow run of a command line its user stopped ends Cancelled on the API, as one
    cancelled from the UI does (the engine records the interrupt as a crash)."""
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with contextlib.suppress(Exception):  # the run's own end goes on whatever happens here
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelled(message="stopped on the command line"), force=True)


def _interrupted(params: list[str]) -> int:
    """A command-line run stopped by SIGTERM or Ctrl-C: at most three lines (what was torn
    down, the bill so far, how to resume), exit 128 + the signal (130 SIGINT, 143 SIGTERM)."""
    import shlex

    signum = COMMAND_LINE.signal or signal.SIGINT
    run = COMMAND_LINE.run
    kept = "".join(f"--param {shlex.quote(p)} " for p in params if not p.startswith("resume="))
    torn_down = {"workers": run["workers"]} if "workers" in run else None
    for line in interrupted_lines(signal.Signals(signum).name, run.get("run_id"), torn_down,
                                  run.get("bill_usd"), run.get("ledger_at"), kept):
        print(line, file=sys.stderr)
    return 128 + int(signum)


if __name__ == "__main__":
    exit_now(main())

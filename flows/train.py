"""The `train` flow: profile -> plan -> provision -> [run_epoch -> checkpoint -> rescale or
re-plan] x epochs -> teardown -> record_cost.

After every epoch the planner is calibrated from what the workers measured
(`planners.calibration`); the next epoch runs the plan a rescale asked for, or else the
plan in force, unless a re-plan found one at least 10 % faster or cheaper (`coordinator.planning.replan`).

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

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from core.keys import init_checkpoint_key, ledger_key, report_key, summary_key
from core.plan import Plan
from flows.hooks import on_abnormal_end
from flows.params import job_fields_flow, job_fields_from_args
from planners.calibration import Calibration, epoch_overhead, fit
from tasks.checkpoint_step import checkpoint
from coordinator.context import ACTIVE, RunContext, run_id_for
from coordinator.cost import worker_seconds
from coordinator.job import EpochSummary, RunSummary, TrainJob
from tasks.plan_step import choose_plan, reconsider_plan
from coordinator.planning import strategy_inputs
from coordinator.warm_prestart import WarmPrestart
from tasks.profile import profile
from tasks.provision import provision
from tasks.record_cost import record_cost
from coordinator.report import artifact_key, markdown_report, plot_curves
from tasks.rescale import rescale
from coordinator.scaling_policy import forecast_workers
from coordinator.resume import find_resume_point
from tasks.run_epoch import run_epoch
from coordinator.run_terms import RunClock, record_terms
from tasks.teardown import teardown
from coordinator.validate import check_target_ready, validate_job
from coordinator.warm_pool import WarmPool, provisional_plan, starts_before_profile


def guardrail(job: TrainJob, ctx: RunContext, plan_, history: list[dict]) -> str | None:
    """`budget_exhausted` / `deadline_reached` when the next epoch would pass the limit, judged
    by the larger of the plan's prediction and the last measured epoch."""
    last = history[-1] if history else None
    next_s = max(plan_.predicted_epoch_s, last["seconds"] if last else 0.0)
    next_usd = max(plan_.predicted_cost_per_epoch_usd, last["cost_usd"] if last else 0.0)
    spent = sum(r.usd for r in ctx.state.ledger) + (time.time() - ctx.started_at) * ctx.price_per_worker_s
    if job.budget_usd is not None and spent + next_usd > job.budget_usd:
        return "budget_exhausted"
    if job.deadline_s is not None and (time.time() - ctx.started_at) + next_s > job.deadline_s:
        return "deadline_reached"
    return None


def target_reached(job: TrainJob, metrics: dict) -> bool:
    acc, loss = metrics.get("val_accuracy"), metrics.get("val_loss")
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


def predicted_cost_at(plan_: Plan, index: int) -> float | None:
    """The bill `plan_` predicted at the end of its `index`-th epoch (None: not predicted)."""
    by_epoch = plan_.predicted_cost_by_epoch_usd
    return by_epoch[index] if 0 <= index < len(by_epoch) else None


def _epoch_progress(ctx: RunContext, progress_id, history: list[dict], predicted_run_cost_usd: float | None) -> None:
    from prefect.artifacts import create_table_artifact

    from coordinator.report import epoch_table

    log_epoch(ctx, history[-1], predicted_run_cost_usd)
    if progress_id is not None:
        update_progress_artifact(progress_id, 100.0 * len(history) / ctx.job.epochs)
    create_table_artifact(key=artifact_key(ctx.run_id, "epochs"), table=epoch_table(history),
                          description=f"Per-epoch history of run {ctx.run_id}")


def log_epoch(ctx: RunContext, metrics: dict, predicted_run_cost_usd: float | None = None) -> str:
    """The coordinator's line for a finished epoch, through the flow's logger (so the UI's log
    and `prefect deployment run --watch` show it): epoch i/N, workers, loss, accuracy, seconds
    against predicted, the bill so far against the run's prediction."""
    from prefect.logging import get_run_logger

    from coordinator.cost import total_usd
    from coordinator.progress import epoch_line
    from coordinator.ledger import rows_now

    line = epoch_line(metrics, ctx.job.epochs, total_usd(rows_now(ctx)), predicted_run_cost_usd)
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

    from coordinator.progress import money

    message = f"run {ctx.run_id} cancelled: its workers were stopped, bill {money(ledger['total_usd'])}"
    get_run_logger().info(f"zooid {message}; resume with --param resume={ctx.run_id}")
    flow_ctx = FlowRunContext.get()
    if flow_ctx is not None and flow_ctx.flow_run is not None:
        current = flow_ctx.flow_run.state
        if current is None or not current.is_final():
            flow_ctx.flow_run.state = Cancelled(message=message)


def _finish(ctx: RunContext, status: str, history: list[dict], plan_dict: dict, ledger: dict,
            error: str | None) -> RunSummary:
    last = history[-1] if history else {}
    summary = RunSummary(
        run_id=ctx.run_id, status=status, final_loss=last.get("val_loss", last.get("train_loss")),
        final_accuracy=last.get("val_accuracy"), total_cost_usd=ledger["total_usd"], plan=plan_dict,
        epochs=[EpochSummary(**{k: v for k, v in e.items() if k in EpochSummary.model_fields}) for e in history],
        store_url=ctx.durable_ref, checkpoint_key=last.get("checkpoint_key", ""), error=error,
        worker_seconds=worker_seconds(ledger["rows"]))
    png = plot_curves([e.model_dump() for e in summary.epochs]) if summary.epochs else None
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


def _run_training(job: TrainJob) -> RunSummary:
    from prefect.runtime import flow_run

    resolved = validate_job(job)  # bad input stops here: nothing provisioned, nothing billed
    check_target_ready(resolved)  # so does a target that is not set up or cannot start a worker
    fr_id = flow_run.id or uuid.uuid4().hex
    ctx = RunContext(run_id=job.resume or run_id_for(fr_id), job=job, resolved=resolved,
                     flow_run_id=str(fr_id))
    resume = find_resume_point(ctx, required=job.resume is not None)
    ACTIVE[ctx.flow_run_id] = ctx
    COMMAND_LINE.run = {"run_id": ctx.run_id, "flow_run_id": ctx.flow_run_id}
    progress_id = ctx.state.progress_id = create_progress_artifact(0.0, description=f"Epochs of run {ctx.run_id}")
    status, error, history, plan_dict = "failed", None, [], {}
    clock = RunClock(first_epoch_fresh=job.resume is None)
    ctx.state.warm = WarmPool(ctx) if job.warm else None
    try:
        if ctx.state.warm is not None and starts_before_profile(ctx):  # their start-up hides behind profile + plan
            ctx.state.warm.ensure(provisional_plan(ctx), resume.next_epoch if resume else 0)
        prof = ctx.state.profile = profile(ctx)
        clock.profiled = "measured" in prof.get("profile_sources", {}).values()
        first_epoch, init, lr, workers = 0, init_checkpoint_key(ctx.run_id), job.lr, job.workers
        if resume is not None:
            first_epoch, init, lr, workers = resume.next_epoch, resume.init_key, resume.lr, resume.workers
            history, ctx.state.ledger = list(resume.history), list(resume.ledger) + ctx.state.ledger  # + the profile's worker
            for rank in range(job.max_workers):  # attempt numbers stay unique across coordinators
                ctx.state.attempts[(first_epoch, rank)] = resume.max_attempt
        calibration = Calibration.from_dict((history[-1].get("replan") or {}).get("calibration") if history else None)
        if resume is not None and resume.plan and resume.plan.get("data_parallel") == workers:
            current = Plan.from_dict(resume.plan)  # the same plan, so a started epoch can go on
        else:
            current = choose_plan(ctx, prof, workers, calibration, job.epochs - first_epoch)
        plan_dict = current.to_dict()
        clock.planned_at = plan_dict["planned_at"] = time.time()  # its run prediction counts from here
        if ctx.state.warm is not None:  # start-up overlaps provisioning
            ctx.state.warm.ensure(current, first_epoch)
        provision(ctx, current, fresh=resume is None)
        status = "completed"
        in_force = (current, first_epoch)  # the plan whose predictions hold, and its first epoch
        for epoch in range(first_epoch, job.epochs):
            if current is not in_force[0]:  # re-planned (or rescaled) after the last epoch
                in_force = (current, epoch)
            if (stop := guardrail(job, ctx, current, history)) is not None:
                status = stop
                break
            resuming = resume is not None and resume.mid_epoch and epoch == first_epoch
            ticks = [epoch_progress_tick(ctx, progress_id, len(history))]
            if ctx.state.warm is not None and epoch + 1 < job.epochs and \
                    (upcoming := forecast_workers(ctx, prof, history, current.data_parallel, lr)):
                ticks.append(WarmPrestart(ctx, current, epoch, upcoming).tick)  # hides the next start-up
            sent = time.time()
            metrics = run_epoch(ctx, current, epoch, init, lr, resuming, on_tick=lambda: [t() for t in ticks])
            clock.epoch(sent, time.time())
            if epoch == first_epoch and current.predicted_first_epoch_s:  # start-up and warm-up in force
                metrics["predicted_epoch_s"] = current.predicted_first_epoch_s
            metrics["predicted_cost_so_far_usd"] = predicted_cost_at(current, epoch - in_force[1])
            init = checkpoint(ctx, epoch, metrics["checkpoint_key"], metrics)
            calibration = fit(current, metrics, calibration, first=epoch == first_epoch,
                              inputs=strategy_inputs(ctx, prof, workers))
            metrics["overhead_s"] = epoch_overhead(current, metrics)
            history.append(metrics)
            _epoch_progress(ctx, progress_id, history, plan_dict.get("predicted_run_cost_usd"))
            if target_reached(job, metrics):
                status = "target_reached"
                break
            if epoch + 1 < job.epochs:
                decision = rescale(ctx, prof, history, workers, lr)
                metrics["rescale"] = decision
                lr = decision["lr"]
                left = job.epochs - epoch - 1
                if decision["workers"] != workers:  # the policy moved the worker budget
                    workers = decision["workers"]
                    current = choose_plan(ctx, prof, workers, calibration, left)
                    metrics["replan"] = {"calibration": calibration.to_dict(), "switched": True,
                                         "reason": f"rescaled to {workers} worker(s) by the {job.scaling} policy",
                                         "predicted_epoch_s": current.predicted_epoch_s}
                else:
                    current, metrics["replan"] = reconsider_plan(ctx, prof, current, calibration, left, workers)
            metrics["plan"] = current.to_dict()
            save_progress(ctx, history)
    except BaseException as exc:
        status = end_state(exc, ctx)
        error = (f"interrupted by {signal.Signals(COMMAND_LINE.signal).name} on the command line"
                 if COMMAND_LINE.active and COMMAND_LINE.signal is not None
                 else "cancelled through Prefect (UI or API)" if status == "cancelled"
                 else f"{type(exc).__name__}: {exc}")
        raise
    finally:
        clock.teardown_at = time.time()
        live = _live_workers(ctx)
        teardown(ctx)
        ledger = record_cost(ctx)  # final before the report renders it; nothing rewrites it
        summary = _finish(ctx, status, history, plan_dict, ledger, error)
        record_terms(ctx, clock, history)  # the next plan on this target predicts from them
        ACTIVE.pop(ctx.flow_run_id, None)
        COMMAND_LINE.run.update(workers=live, bill_usd=ledger["total_usd"], ledger_at=_ledger_at(ctx))
        if status == "cancelled":
            with contextlib.suppress(Exception):  # the run's own end goes on whatever happens here
                _log_cancelled(ctx, ledger)
    return summary


def _live_workers(ctx: RunContext) -> int:
    """Worker processes or flow runs of the run still alive before its teardown."""
    from coordinator.sweep import tagged_pids

    try:
        return len(tagged_pids(ctx.run_id)) or len(ctx.state.warm.workers if ctx.state.warm is not None else [])
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
    from blocks.store_refs import open_store_ref
    from coordinator.cost import read_ledger

    try:
        store = open_store_ref(summary.store_url)
        try:
            return read_ledger(store, summary.run_id)
        finally:
            store.close()
    except Exception:  # the report without it still says what ran
        return None


def save_progress(ctx: RunContext, history: list[dict]) -> None:
    """History and the bill so far, so a killed coordinator leaves both behind."""
    from coordinator.ledger import record_cost_now
    from coordinator.resume import write_history

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

    def reset(self, active: bool) -> None:
        self.active, self.signal, self.run = active, None, {}

    def stop(self, signum: int) -> bool:
        """Note the first stop signal and quiet the console; False for a later one."""
        if self.signal is not None:
            return False
        self.signal = signum
        _quiet_console()
        return True

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
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def interrupt(signum, frame):
        if COMMAND_LINE.stop(signum):
            raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    previous_int = signal.signal(signal.SIGINT, interrupt)
    try:
        if PREFECT_API_URL.value():
            yield
            return
        from deployments.server import drain_prefect_clients, temporary_server

        with temporary_server(started=server) as url, temporary_settings(updates={PREFECT_API_URL: url}):
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

    from deployments.bootstrap import PAID_WORKERS, ensure_concurrency_limit

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
            fields = job_fields_from_args(args.param)
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
    from deployments.server import TemporaryServer

    return TemporaryServer()


def _validated_run(args, fields: dict, server) -> int:
    from pydantic import ValidationError

    from core.errors import ZooidValueError
    from coordinator.job import format_validation_error
    from coordinator.report import text_report

    try:
        job = TrainJob(**fields)
        validate_job(job)
    except ValidationError as exc:
        print(f"error: {format_validation_error(exc)}", file=sys.stderr)
        return 2
    except ZooidValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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

    from coordinator.progress import interrupted_lines

    signum = COMMAND_LINE.signal or signal.SIGINT
    run = COMMAND_LINE.run
    kept = "".join(f"--param {shlex.quote(p)} " for p in params if not p.startswith("resume="))
    torn_down = {"workers": run["workers"]} if "workers" in run else None
    for line in interrupted_lines(signal.Signals(signum).name, run.get("run_id"), torn_down,
                                  run.get("bill_usd"), run.get("ledger_at"), kept):
        print(line, file=sys.stderr)
    return 128 + int(signum)


if __name__ == "__main__":
    sys.exit(main())

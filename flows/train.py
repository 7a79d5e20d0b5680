"""The `train` flow: profile -> plan -> provision -> [run_epoch -> checkpoint -> rescale or
re-plan] x epochs -> teardown -> record_cost.

After every epoch the planner is calibrated from what the workers measured
(`planners.calibration`); the next epoch runs the plan a rescale asked for, or else the
plan in force, unless a re-plan found one at least 10 % faster or cheaper (`tasks.plan.replan`).

`train(job)` takes a `TrainJob`; `train_with_params(**fields)` is the same flow with one
parameter per `TrainJob` field, which is what deployments run, so that
`prefect deployment run train/local --param workers=3` works and the UI shows a flat form.
From a shell: `python -m flows.train --param workers=2 --param epochs=3 [--summary-out PATH]`.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import time
import uuid

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from core.plan import Plan
from flows.hooks import on_abnormal_end
from flows.params import job_fields_flow, job_fields_from_args
from planners.calibration import Calibration, epoch_overhead, fit
from tasks.checkpoint import checkpoint
from tasks.context import ACTIVE, RunContext, run_id_for
from tasks.cost import worker_seconds
from tasks.job import EpochSummary, RunSummary, TrainJob
from tasks.plan import plan, replan_task, strategy_inputs
from tasks.prestart import WarmPrestart
from tasks.profile import profile
from tasks.provision import init_key, provision
from tasks.record_cost import record_cost
from tasks.report import artifact_key, markdown_report, plot_curves
from tasks.rescale import forecast_workers, rescale
from tasks.resume import find_resume_point
from tasks.run_epoch import run_epoch
from tasks.run_terms import RunClock, record_terms
from tasks.teardown import teardown
from tasks.validate import check_target_ready, validate_job
from tasks.warm_pool import WarmPool, provisional_plan, starts_before_profile


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


def _epoch_progress(ctx: RunContext, progress_id, history: list[dict]) -> None:
    from prefect.artifacts import create_table_artifact

    from tasks.report import epoch_table

    if progress_id is not None:
        update_progress_artifact(progress_id, 100.0 * len(history) / ctx.job.epochs)
    create_table_artifact(key=artifact_key(ctx.run_id, "epochs"), table=epoch_table(history),
                          description=f"Per-epoch history of run {ctx.run_id}")


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
        store.put(ctx.prefix("summary.json"), summary.model_dump_json(indent=1).encode())
        if png:
            store.put(ctx.prefix("report", "curves.png"), png)
    finally:
        store.close()
    create_markdown_artifact(key=artifact_key(ctx.run_id, "report"),
                             markdown=markdown_report(summary, ledger["rows"], png),
                             description=f"Plan, epochs and bill of run {ctx.run_id}")
    return summary


def run_training(job: TrainJob) -> RunSummary:
    """The recipe; each step is a retried Prefect task."""
    from prefect.runtime import flow_run

    resolved = validate_job(job)  # bad input stops here: nothing provisioned, nothing billed
    check_target_ready(resolved)  # so does a target that is not set up or cannot start a worker
    fr_id = flow_run.id or uuid.uuid4().hex
    ctx = RunContext(run_id=job.resume or run_id_for(fr_id), job=job, resolved=resolved,
                     flow_run_id=str(fr_id))
    resume = find_resume_point(ctx, required=job.resume is not None)
    ACTIVE[ctx.flow_run_id] = ctx
    progress_id = ctx.state.progress_id = create_progress_artifact(0.0, description=f"Epochs of run {ctx.run_id}")
    status, error, history, plan_dict = "failed", None, [], {}
    clock = RunClock(first_epoch_fresh=job.resume is None)
    ctx.state.warm = WarmPool(ctx) if job.warm else None
    try:
        if ctx.state.warm is not None and starts_before_profile(ctx):  # their start-up hides behind profile + plan
            ctx.state.warm.ensure(provisional_plan(ctx), resume.next_epoch if resume else 0)
        prof = ctx.state.profile = profile(ctx)
        clock.profiled = "measured" in prof.get("profile_sources", {}).values()
        first_epoch, init, lr, workers = 0, init_key(ctx), job.lr, job.workers
        if resume is not None:
            first_epoch, init, lr, workers = resume.next_epoch, resume.init_key, resume.lr, resume.workers
            history, ctx.state.ledger = list(resume.history), list(resume.ledger) + ctx.state.ledger  # + the profile's worker
            for rank in range(job.max_workers):  # attempt numbers stay unique across coordinators
                ctx.state.attempts[(first_epoch, rank)] = resume.max_attempt
        calibration = Calibration.from_dict((history[-1].get("replan") or {}).get("calibration") if history else None)
        if resume is not None and resume.plan and resume.plan.get("data_parallel") == workers:
            current = Plan.from_dict(resume.plan)  # the same plan, so a started epoch can go on
        else:
            current = plan(ctx, prof, workers, calibration, job.epochs - first_epoch)
        plan_dict = current.to_dict()
        clock.planned_at = time.time()
        if ctx.state.warm is not None:  # start-up overlaps provisioning
            ctx.state.warm.ensure(current, first_epoch)
        provision(ctx, current, fresh=resume is None)
        status = "completed"
        for epoch in range(first_epoch, job.epochs):
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
            init = checkpoint(ctx, epoch, metrics["checkpoint_key"], metrics)
            calibration = fit(current, metrics, calibration, first=epoch == first_epoch,
                              inputs=strategy_inputs(ctx, prof, workers))
            metrics["overhead_s"] = epoch_overhead(current, metrics)
            history.append(metrics)
            _epoch_progress(ctx, progress_id, history)
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
                    current = plan(ctx, prof, workers, calibration, left)
                    metrics["replan"] = {"calibration": calibration.to_dict(), "switched": True,
                                         "reason": f"rescaled to {workers} worker(s) by the {job.scaling} policy",
                                         "predicted_epoch_s": current.predicted_epoch_s}
                else:
                    current, metrics["replan"] = replan_task(ctx, prof, current, calibration, left, workers)
            metrics["plan"] = current.to_dict()
            save_progress(ctx, history)
    except BaseException as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        clock.teardown_at = time.time()
        teardown(ctx)
        ledger = record_cost(ctx)
        summary = _finish(ctx, status, history, plan_dict, ledger, error)
        record_terms(ctx, clock, history)  # the next plan on this target predicts from them
        ACTIVE.pop(ctx.flow_run_id, None)
    return summary


def save_progress(ctx: RunContext, history: list[dict]) -> None:
    """History and the bill so far, so a killed coordinator leaves both behind."""
    from tasks.record_cost import record_cost_now
    from tasks.resume import write_history

    store = ctx.open_durable()
    try:
        write_history(store, ctx.run_id, history)
    finally:
        store.close()
    record_cost_now(ctx, final=False)


_HOOKS = dict(on_failure=[on_abnormal_end], on_crashed=[on_abnormal_end], on_cancellation=[on_abnormal_end])


@flow(name="train", result_serializer="json", log_prints=True, **_HOOKS)
def train(job: TrainJob = TrainJob()) -> RunSummary:
    """Train `job` end to end and return its summary (also at runs/<run_id>/summary.json)."""
    return run_training(job)


train_with_params = job_fields_flow(run_training, name="train", result_serializer="json", log_prints=True,
                                    description="Train a model with Zooid (one parameter per TrainJob field).",
                                    **_HOOKS)


@contextlib.contextmanager
def prefect_api():
    """The Prefect API for a command-line run: the configured one, or a temporary server of
    our own that outlives a Ctrl-C (`deployments.server.temporary_server`); SIGTERM is turned
    into KeyboardInterrupt, so either one runs the flow's teardown and bill before exiting."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        if PREFECT_API_URL.value():
            yield
            return
        from deployments.server import temporary_server

        with temporary_server() as url, temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield
            finally:  # the run's logs and events reach the server before it stops
                from prefect.events.worker import EventsWorker
                from prefect.logging.handlers import APILogWorker

                for service in (APILogWorker, EventsWorker):
                    service.drain_all(timeout=5, at_exit=False)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.train --param name=value ... [--summary-out PATH]`."""
    import argparse

    from pydantic import ValidationError

    from core.errors import ZooidValueError
    from tasks.job import format_validation_error
    from tasks.report import text_report

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
    try:
        job = TrainJob(**fields)
        validate_job(job)
    except ValidationError as exc:
        print(f"error: {format_validation_error(exc)}", file=sys.stderr)
        return 2
    except ZooidValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with prefect_api():
            summary = train(job)
    except ZooidValueError as exc:  # found once measured, e.g. a stage that does not fit memory
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted: the run's workers were stopped and its bill recorded", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"error: run failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return 1
    print(text_report(summary))
    if args.summary_out:
        with open(args.summary_out, "w") as fh:
            fh.write(summary.model_dump_json(indent=1))
    return 0 if summary.status != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())

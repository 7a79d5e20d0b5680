"""The `plan` flow: a dry run. Profile the model and the store, plan, and report what each
strategy would cost, without provisioning anything.

    python -m flows.dry_run --param model=digits_cnn --param workers=4
    python -m flows.dry_run --param model=digits_cnn --param rent=false

To measure the profile it rents one worker on the target (unless the profile is cached), and says
so before it starts, with what that is predicted to cost. With `rent=false` it rents nothing: it
plans from a cached profile of the same device class and says where and when that was taken, or,
with none cached, from the catalog's figures (the model's flops and bytes at the target device's
assumed rates, `coordinator.plan.target_profile.catalog_profile`) and says how uncertain that plan is.

For each candidate (Local-SGD, pipeline, hybrid D x M at the job's worker budget) it reports
the predicted iteration time, epoch time, cost per epoch and throughput per dollar, and which
one the planner would choose; where the target offers several worker sizes, what the
co-optimiser compared (or, with one size, why it was not needed); where it has a spot offer, the
run's bill on-demand and on spot with the expected preemptions' re-done work (`planners.spot`).
"""
from __future__ import annotations

import inspect
import sys
import uuid

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from coordinator.plan.target_profile import cached_profile, profile_estimate, will_rent
from coordinator.report.report import (alternatives_table, co_optimizer_lines, plan_in_words, run_terms_text,
                                      store_prediction_words)
from coordinator.run.context import RunContext, run_id_for
from coordinator.run.job import TrainJob
from coordinator.run.job_fields import job_from_fields
from coordinator.run.outer_step import log_outer_settings
from coordinator.run.validate import check_target_ready, validate_job
from core.errors import ZooidValueError
from core.formats import duration, money
from core.keys import artifact_key
from flows.params import job_fields_flow, param_main
from planners.spot import choice_words
from tasks.plan_step import choose_plan
from tasks.profile import profile, show_profile


def plan_report(job: TrainJob, chosen: dict) -> str:
    """The dry run's markdown: the plan in words and its prediction, every alternative once
    (the report's table), the terms outside the workers' compute, the co-optimiser's verdict."""
    terms = run_terms_text(chosen.get("run_terms") or {})
    return "\n".join([
        f"# Zooid plan for `{job.model}` on `{job.dataset}` ({job.workers} workers, target `{job.target}`)", "",
        plan_in_words(chosen), "",
        f"Predicted: {duration(chosen['predicted_epoch_s'])} and {money(chosen['predicted_cost_per_epoch_usd'])} per "
        f"epoch; the run of {job.epochs} epochs {duration(chosen['predicted_run_s'])} and "
        f"{money(chosen['predicted_run_cost_usd'])} (first epoch {duration(chosen['predicted_first_epoch_s'])}; "
        "start-up, idle workers, the coordinator and the store included).", "",
        *([choice_words(chosen["capacity_choice"]), ""] if chosen.get("capacity_choice") else []),
        *([f"Store: {store_prediction_words(chosen)}.", ""] if chosen.get("predicted_store_ops") else []),
        "## Alternatives considered", "", *alternatives_table(chosen, markdown=True),
        *(["", f"Outside the workers' compute: {terms}."] if terms else []),
        *([""] + co_optimizer_lines(chosen["co_optimizer"]) if chosen.get("co_optimizer") else [])])


def _seconds(est: dict, name: str) -> str:
    return f"{duration(est[name])}{'' if est['measured'][name] else ' (assumed)'}"


def rent_notice(ctx: RunContext) -> str:
    """The line the dry run says before it starts: what it will rent and what that is predicted to cost."""
    r = ctx.resolved
    if not will_rent(ctx):
        return (f"zooid dry run: the profile of {ctx.job.model} on target {r.target_name!r} is cached; "
                "nothing will be rented")
    est = profile_estimate(ctx)
    return (f"zooid dry run: will rent one profiling worker on target {r.target_name!r} (offer {r.offer.name}, "
            f"{r.target.worker_vcpu:g} vCPU, {r.target.worker_memory_gb:g} GB"
            f"{f', {r.target.worker_gpu} GPU' if r.target.worker_gpu else ''}) to measure {ctx.job.model} and the "
            f"store, then stop it: estimated {money(est['usd'])} (start-up {_seconds(est, 'startup_s')} + profile "
            f"{_seconds(est, 'profile_s')} + stop {_seconds(est, 'stop_s')} at {money(est['price_per_s'])}/s; an "
            "estimate: the bill is measured); rent=false rents nothing and plans from a cached profile or "
            "the catalog's figures")


def _rent_flag(rent) -> bool:
    if isinstance(rent, str):
        if rent.strip().lower() in ("true", "1", "yes"):
            return True
        if rent.strip().lower() in ("false", "0", "no"):
            return False
        raise ZooidValueError("rent", f"must be true or false, got {rent!r}")
    return bool(rent)


def dry_run(job: TrainJob, rent: bool = True) -> dict:
    """Profile and plan `job` without provisioning; return the chosen plan and its alternatives.
    `rent` False: rent nothing, plan from a cached profile or the catalog's figures
    (`coordinator.plan.target_profile.cached_profile`)."""
    from prefect.runtime import flow_run

    rent = _rent_flag(rent)
    resolved = validate_job(job)
    if rent:
        check_target_ready(resolved)
    ctx = RunContext(run_id=run_id_for(flow_run.id or uuid.uuid4().hex), job=job, resolved=resolved, dry_run=True)
    if rent:
        print(rent_notice(ctx))
        prof = ctx.state.profile = profile(ctx)
    else:
        prof, note = cached_profile(ctx)
        ctx.state.profile = prof
        print(note)
        show_profile(prof)
    planned = choose_plan(ctx, prof)
    log_outer_settings(job, planned.steps_per_epoch)  # what the sync period chose, or a warning
    chosen = planned.to_dict()
    markdown = plan_report(job, chosen)
    create_markdown_artifact(key=artifact_key(ctx.run_id, "plan"), markdown=markdown,
                             description=f"Dry run of {job.model}: strategies, time and cost")
    print(markdown)
    return chosen


@flow(name="plan", result_serializer="json", log_prints=True)
def plan(job: TrainJob = TrainJob(), rent: bool = True) -> dict:
    """Profile and plan `job` without provisioning; return the chosen plan and its alternatives.
    `rent` false: rent no profiling worker, plan from a cached profile of the same device class
    or, with none, from the catalog's figures."""
    return dry_run(job, rent)


RENT_DESCRIPTION = ("Rent one worker on the target to take the profile when it is not cached; false: rent "
                    "nothing, plan from a cached profile of the same device class, else from the catalog's figures")


def _with_rent(fields_flow):
    """The job-fields flow `fields_flow` (`flows.params.job_fields_flow`) plus a `rent` parameter
    (default true) passed to `dry_run`."""
    base = inspect.signature(fields_flow.fn)

    def run(rent: bool = True, **fields):
        return dry_run(job_from_fields(fields), rent)

    run.__name__ = fields_flow.fn.__name__
    run.__signature__ = base.replace(parameters=[
        *base.parameters.values(), inspect.Parameter("rent", inspect.Parameter.KEYWORD_ONLY, default=True,
                                                     annotation=bool)])
    run.__doc__ = f"{fields_flow.fn.__doc__}\n    rent: {RENT_DESCRIPTION}"
    return flow(name=fields_flow.name, description=fields_flow.description, validate_parameters=False,
                result_serializer="json", log_prints=True)(run)


plan_with_params = _with_rent(job_fields_flow(dry_run, name="plan", result_serializer="json", log_prints=True,
                                              description="Dry run: profile and plan a Zooid job, provision nothing."))


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.dry_run --param name=value ...`: print the dry run's table."""
    def run(fields: dict) -> None:
        rent = fields.pop("rent", True)
        plan(job_from_fields(fields), _rent_flag(rent))

    return param_main(argv, "python -m flows.dry_run", __doc__.splitlines()[0], run)

if __name__ == "__main__":
    sys.exit(main())

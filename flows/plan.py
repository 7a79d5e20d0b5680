"""The `plan` flow: a dry run. Profile the model and the store, plan, and report what each
strategy would cost, without provisioning anything.

    python -m flows.plan --param model=digits_cnn --param workers=4

For each candidate (Local-SGD, pipeline, hybrid D x M at the job's worker budget) it reports
the predicted iteration time, epoch time, cost per epoch and throughput per dollar, and which
one the planner would choose; where the target offers several worker sizes, what the
co-optimiser compared (or, with one size, why it was not needed).
"""
from __future__ import annotations

import sys
import uuid

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.params import job_fields_flow, job_fields_from_args
from tasks.context import RunContext, run_id_for
from tasks.job import TrainJob
from tasks.plan import plan as plan_task
from tasks.profile import profile
from tasks.report import artifact_key, co_optimizer_lines
from tasks.validate import check_target_ready, validate_job


def plan_report(job: TrainJob, chosen: dict) -> str:
    """The dry run's markdown: one row per candidate."""
    rows = ["| strategy | D | M | workers | cuts | micro-batches | schedule | iteration s | epoch s | $ / epoch | "
            "run s | run $ | samples/s per $/h | chosen |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in chosen["alternatives"]:
        tpd = a.get("throughput_per_dollar")
        schedule = a.get("pipeline_schedule") or "-"
        if a.get("compared") == "schedule":  # the chosen pipeline under each schedule
            schedule += "" if a.get("fits") else " (does not fit)"
        strategy = a["strategy"] + (f" ({'/'.join(f'{g:g}' for g in a['stage_memory_gb'])} GB per stage)"
                                    if a.get("stage_memory_gb") else "")
        rows.append(f"| {strategy} | {a['data_parallel']} | {a['stages']} | {a['workers']} | {a['cuts']} | "
                    f"{a['microbatches']} | {schedule} | {a['predicted_iteration_s']:.3g} | "
                    f"{a['predicted_epoch_s']:.3g} | {a['predicted_cost_per_epoch_usd']:.3g} | "
                    f"{a.get('predicted_run_s', 0):.3g} | {a.get('predicted_run_cost_usd', 0):.3g} | "
                    f"{'-' if tpd is None else f'{tpd:.3g}'} | {'yes' if a['chosen'] else ''} |")
    terms = chosen.get("run_terms") or {}
    basis = ", ".join(f"{k} {terms[k]:.3g} s{'' if terms['measured'].get(k) else ' (assumed)'}"
                      for k in terms if k != "measured" and terms[k] is not None)
    return "\n".join([f"# Zooid plan for `{job.model}` on `{job.dataset}` ({job.workers} workers, {job.target})", "",
                      *rows, "", f"Chosen: **{chosen['strategy']}**, D={chosen['data_parallel']}, "
                      f"M={chosen['stages']}; predicted {chosen['predicted_epoch_s']:.3g} s and "
                      f"${chosen['predicted_cost_per_epoch_usd']:.3g} per epoch; the run of {job.epochs} epochs "
                      f"{chosen['predicted_run_s']:.3g} s and ${chosen['predicted_run_cost_usd']:.3g} (first epoch "
                      f"{chosen['predicted_first_epoch_s']:.3g} s; start-up, idle workers and the coordinator "
                      f"included).", "", f"Outside the workers' compute: {basis}.",
                      *([""] + co_optimizer_lines(chosen["co_optimizer"]) if chosen.get("co_optimizer") else [])])


def dry_run(job: TrainJob) -> dict:
    """Profile and plan `job` without provisioning; return the chosen plan and its alternatives."""
    from prefect.runtime import flow_run

    resolved = validate_job(job)
    check_target_ready(resolved)
    ctx = RunContext(run_id=run_id_for(flow_run.id or uuid.uuid4().hex), job=job, resolved=resolved, dry_run=True)
    prof = ctx.state.profile = profile(ctx)
    chosen = plan_task(ctx, prof).to_dict()
    markdown = plan_report(job, chosen)
    create_markdown_artifact(key=artifact_key(ctx.run_id, "plan"), markdown=markdown,
                             description=f"Dry run of {job.model}: strategies, time and cost")
    print(markdown)
    return chosen


@flow(name="plan", result_serializer="json", log_prints=True)
def plan(job: TrainJob = TrainJob()) -> dict:
    """Profile and plan `job` without provisioning; return the chosen plan and its alternatives."""
    return dry_run(job)


plan_with_params = job_fields_flow(dry_run, name="plan", result_serializer="json", log_prints=True,
                                   description="Dry run: profile and plan a Zooid job, provision nothing.")


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.plan --param name=value ...`: print the dry run's table."""
    import argparse

    from pydantic import ValidationError

    from tasks.job import format_validation_error

    parser = argparse.ArgumentParser(prog="python -m flows.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    try:
        plan(TrainJob(**job_fields_from_args(args.param)))
    except ValidationError as exc:
        print(f"error: {format_validation_error(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:  # ZooidValueError and a malformed --param
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Flows whose parameters are the `TrainJob` fields, one each, for deployments.

`prefect deployment run train/local --param workers=3` and the UI's form both need flat
parameters, while Python callers pass one `TrainJob`. `job_fields_flow` wraps a function of a
`TrainJob` into a flow whose signature is the job's fields (with their defaults, types and
descriptions); the job is built by `coordinator.run.job_fields.job_from_fields`, so a field pydantic
refuses fails the run with one line naming it.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

from prefect import flow

from coordinator.run.job import TrainJob
from coordinator.run.job_fields import fields_from_args, job_from_fields
from core.errors import ZooidValueError


def log_refusal(exc: ZooidValueError) -> None:
    """The run's one-line refusal in its log, sent to the API before the run ends Failed:
    `prefect deployment run --watch` stops at the final state's event, before Prefect's own
    batched log of the exception arrives, so it shows this line and the state, not the reason."""
    from prefect.logging import get_run_logger
    from prefect.logging.handlers import APILogHandler

    get_run_logger().error(f"error: {exc}")
    APILogHandler().flush()  # (what the handler does at exit: drain the batch, 5 s at most)


def job_fields_flow(fn: Callable[[TrainJob], Any], *, name: str, description: str, **flow_options):
    """A flow named `name` taking one keyword parameter per TrainJob field and calling `fn`."""

    def run(**fields):
        try:
            return fn(job_from_fields(fields))  # bad input: a one-line ZooidValueError, the run's state message
        except ZooidValueError as exc:
            log_refusal(exc)
            raise

    run.__name__ = f"{name}_with_params"
    run.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.annotation)
         for n, f in TrainJob.model_fields.items()],
        return_annotation=inspect.signature(fn).return_annotation)
    run.__doc__ = f"{description}\n\nArgs:\n" + "\n".join(
        f"    {n}: {f.description or f.title or n}" for n, f in TrainJob.model_fields.items())
    return flow(name=name, validate_parameters=False, **flow_options)(run)


def param_main(argv: list[str] | None, prog: str, description: str, run: Callable[[dict[str, Any]], Any]) -> int:
    """A `python -m <prog> --param NAME=VALUE ...` command: `run(params)`; bad input (a
    ZooidValueError, a malformed --param) is one `error:` line on stderr and exit code 2."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    try:
        run(fields_from_args(args.param))
    except ValueError as exc:  # ZooidValueError and a malformed --param
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

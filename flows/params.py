"""Flows whose parameters are the `TrainJob` fields, one each, for deployments.

`prefect deployment run train/local --param workers=3` and the UI's form both need flat
parameters, while Python callers pass one `TrainJob`. `job_fields_flow` wraps a function of a
`TrainJob` into a flow whose signature is the job's fields (with their defaults, types and
descriptions); the job is built by `coordinator.run.job_fields.job_from_fields`, so a field pydantic
refuses fails the run with one line naming it.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from prefect import flow

from coordinator.run.job import TrainJob
from coordinator.run.job_fields import job_from_fields
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

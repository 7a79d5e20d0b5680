"""A job given as flat fields (`--param NAME=VALUE`, the UI's form, a deployment run's
parameters), checked into a `TrainJob`: one set of functions for every way in.

`make run` (`deployments.stack`) checks the fields before it starts anything, with no Prefect
API (`check_fields(..., api=False)`); `python -m flows.train` checks them the same way with the
API; the `train` flow builds its job with `job_from_fields` and validates it
(`coordinator.run.validate.validate_job`), so a deployment run with bad input ends Failed with the
same one line as its state message. Every refusal is a `ZooidValueError` naming the field.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from coordinator.run.job import TrainJob, format_validation_error, parse_param_value
from core.errors import ZooidValueError


def fields_from_args(params: list[str]) -> dict[str, Any]:
    """`--param NAME=VALUE` items as TrainJob fields (values parsed as JSON where they can be);
    ValueError for an item without `=`."""
    fields = {}
    for item in params:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param {item!r}: expected NAME=VALUE")
        fields[name.strip()] = parse_param_value(value)
    return fields


def job_from_fields(fields: dict[str, Any]) -> TrainJob:
    """The `TrainJob` of `fields`; a field pydantic refuses (unknown, wrong type, out of range)
    is a one-line ZooidValueError naming it (an unknown one with the valid fields listed)."""
    try:
        return TrainJob(**fields)
    except ValidationError as exc:
        field, _, message = format_validation_error(exc).partition(": ")
        raise ZooidValueError(field, message) from None


def check_fields(fields: dict[str, Any], *, api: bool = True) -> TrainJob:
    """`fields` as a validated `TrainJob`, refused with a one-line ZooidValueError naming the
    field. `api=False`: no Prefect API is asked (a block-named target or store is left to the
    run: `coordinator.run.validate.validate_without_api`)."""
    job = job_from_fields(fields)  # (refused here, a field costs no import of Prefect or torch)
    from coordinator.run.validate import validate_job, validate_without_api  # imports Prefect

    if api:
        validate_job(job)
    else:
        validate_without_api(job)
    return job

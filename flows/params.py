"""Flows whose parameters are the `TrainJob` fields, one each, for deployments.

`prefect deployment run train/local --param workers=3` and the UI's form both need flat
parameters, while Python callers pass one `TrainJob`. `job_fields_flow` wraps a function of a
`TrainJob` into a flow whose signature is the job's fields (with their defaults, types and
descriptions); the job is validated by pydantic when the flow builds it.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from prefect import flow

from coordinator.job import TrainJob, parse_param_value


def job_fields_from_args(params: list[str]) -> dict[str, Any]:
    """`--param NAME=VALUE` items as TrainJob fields (values parsed as JSON where they can be);
    ValueError for an item without `=`."""
    fields = {}
    for item in params:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param {item!r}: expected NAME=VALUE")
        fields[name.strip()] = parse_param_value(value)
    return fields


def job_fields_flow(fn: Callable[[TrainJob], Any], *, name: str, description: str, **flow_options):
    """A flow named `name` taking one keyword parameter per TrainJob field and calling `fn`."""

    def run(**fields):
        return fn(TrainJob(**fields))

    run.__name__ = f"{name}_with_params"
    run.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.annotation)
         for n, f in TrainJob.model_fields.items()],
        return_annotation=inspect.signature(fn).return_annotation)
    run.__doc__ = f"{description}\n\nArgs:\n" + "\n".join(
        f"    {n}: {f.description or f.title or n}" for n, f in TrainJob.model_fields.items())
    return flow(name=name, validate_parameters=False, **flow_options)(run)

"""ECS answers and requests held to botocore's service model for ECS.

botocore validates what a client sends (`botocore.validate.ParamValidator`) but parses answers
leniently: a member its model does not know is dropped without a word. `check_output` walks an
answer over the operation's output shape and refuses an unknown member, a missing required
member, a value of the wrong type or one outside its enum. An answer is checked either as it
crosses the wire (`wire=True`: JSON, timestamps in epoch seconds, as ECS's JSON protocol sends
them) or as botocore returns it after parsing (datetimes), which is what a `Stubber` is given.
`check_input` runs a request's parameters through botocore's own input validation.
"""
from __future__ import annotations

from datetime import datetime
from functools import cache

from tests.provider_schemas import SchemaError, raise_on


@cache
def service_model():
    """botocore's ECS service model (the JSON shipped inside botocore)."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("ecs")
    assert model.metadata["protocol"] == "json"  # the wire form `check_output(wire=True)` expects
    return model


def check_input(operation: str, params: dict) -> dict:
    """`params` of `operation` (e.g. "DescribeTasks") through botocore's ParamValidator; returned unchanged."""
    from botocore.validate import ParamValidator

    shape = service_model().operation_model(operation).input_shape
    report = ParamValidator().validate(params, shape)
    if report.has_errors():
        raise SchemaError(f"ECS {operation} request", [report.generate_report()])
    return params


def check_output(operation: str, response: dict, wire: bool = False) -> dict:
    """`response` of `operation` walked strictly over its output shape; returned unchanged."""
    shape = service_model().operation_model(operation).output_shape
    body = dict(response)
    if not wire:
        body.pop("ResponseMetadata", None)  # botocore adds it after parsing
    problems: list[str] = []
    _walk(shape, body, operation, wire, problems)
    raise_on(f"ECS {operation} answer", problems)
    return response


def _walk(shape, value, path: str, wire: bool, problems: list[str]) -> None:
    kind = shape.type_name
    if kind == "structure":
        if not isinstance(value, dict):
            problems.append(f"{path}: {shape.name} is an object, got {type(value).__name__}")
            return
        problems += [f"{path}.{k}: not a member of {shape.name}" for k in value if k not in shape.members]
        problems += [f"{path}.{k}: required by {shape.name}, missing" for k in shape.required_members
                     if k not in value]
        for k, v in value.items():
            if k in shape.members:
                _walk(shape.members[k], v, f"{path}.{k}", wire, problems)
    elif kind == "list":
        if not isinstance(value, list):
            problems.append(f"{path}: a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _walk(shape.member, item, f"{path}[{i}]", wire, problems)
    elif kind == "map":
        if not isinstance(value, dict):
            problems.append(f"{path}: a map, got {type(value).__name__}")
            return
        for k, v in value.items():
            _walk(shape.key, k, f"{path} key {k!r}", wire, problems)
            _walk(shape.value, v, f"{path}[{k!r}]", wire, problems)
    elif not _scalar_ok(kind, value, wire):
        problems.append(f"{path}: {kind} ({shape.name}), got {type(value).__name__} {value!r}")
    elif kind == "string" and shape.enum and value not in shape.enum:
        problems.append(f"{path}: {value!r} is not one of {shape.name} {shape.enum}")


def _scalar_ok(kind: str, value, wire: bool) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind in ("integer", "long"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in ("float", "double"):
        return number
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "timestamp":  # epoch seconds on the JSON wire; an aware datetime once parsed
        return number if wire else isinstance(value, datetime) and value.tzinfo is not None
    if kind == "blob":
        return isinstance(value, str) if wire else isinstance(value, (bytes, bytearray))
    return False


def check_error(operation: str, body: dict) -> dict:
    """An error answer on the JSON wire (`{"__type": ..., "message": ...}`): `__type` names one of
    the operation's errors and the rest is that error's shape; returned unchanged."""
    errors = {s.name: s for s in service_model().operation_model(operation).error_shapes}
    name = str(body.get("__type", "")).rsplit("#", 1)[-1]
    if name not in errors:
        raise SchemaError(f"ECS {operation} error", [f"__type {body.get('__type')!r} is not one of {sorted(errors)}"])
    problems: list[str] = []
    _walk(errors[name], {k: v for k, v in body.items() if k != "__type"}, name, True, problems)
    raise_on(f"ECS {operation} error", problems)
    return body

"""Kubernetes API answers held to the kubernetes client's models (`kubernetes.client.models`).

A generated model declares its JSON in `attribute_map` (attribute -> key) and `openapi_types`
(attribute -> `str`, `int`, `float`, `bool`, `datetime`, `date`, `object`, `list[T]`,
`dict[str, T]` or another model). The client's own `ApiClient.deserialize` reads only the keys
it knows and converts what it finds (`str(5)`, `int("5")`); `check` walks a document over those
maps and refuses an unknown key, a value of the wrong type or a time that is not RFC 3339, and a
top-level `kind` other than the model's, then deserializes it with `ApiClient.deserialize`, whose
models refuse a missing required member (client-side validation).

The kubernetes_asyncio client the code uses is generated from the same OpenAPI document; the
synchronous `kubernetes` package is used here because its `ApiClient` needs no event loop.
A quantity (`resources.limits`) is a string in every answer: the API server accepts a number in a
request and answers with the canonical string (`1` -> "1", "4000m" -> "4").
"""
from __future__ import annotations

import json
import re
from functools import cache
from types import SimpleNamespace

from tests.provider_schemas import SchemaError, raise_on

_RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
_DATE = re.compile(r"^\d{4}-\d\d-\d\d$")
_CONTAINER = re.compile(r"^(list)\[(.*)\]$|^dict[\[(]str, (.*)[\])]$")


@cache
def _api_client():
    from kubernetes.client import ApiClient

    return ApiClient()


def check(model: str, body: dict) -> dict:
    """`body` held to the model named `model` (e.g. "V1Pod", "V1PodList", "V1Status"); returned unchanged."""
    from kubernetes.client import models

    cls = getattr(models, model)
    problems: list[str] = []
    kind = model[2:] if model.startswith("V1") else None
    if kind is not None and isinstance(body, dict) and body.get("kind", kind) != kind:
        problems.append(f"{model}.kind: {body['kind']!r}, not {kind!r}")
    _model(models, cls, body, model, problems)
    raise_on(f"Kubernetes {model}", problems)
    try:
        _api_client().deserialize(SimpleNamespace(data=json.dumps(body)), model)
    except ValueError as exc:  # a required member missing, as the client's models refuse it
        raise SchemaError(f"Kubernetes {model}", [str(exc)]) from None
    return body


def _model(models, cls, data, path: str, problems: list[str]) -> None:
    if not isinstance(data, dict):
        problems.append(f"{path}: {cls.__name__} is an object, got {type(data).__name__}")
        return
    by_key = {key: attr for attr, key in cls.attribute_map.items()}
    for key, value in data.items():
        attr = by_key.get(key)
        if attr is None:
            problems.append(f"{path}.{key}: not a member of {cls.__name__}")
        else:
            _value(models, cls.openapi_types[attr], value, f"{path}.{key}", problems)


def _value(models, kind: str, value, path: str, problems: list[str]) -> None:
    if value is None:  # the API omits what is unset; required members are the models' own check
        return
    container = _CONTAINER.match(kind)
    if container:
        if container.group(1):
            if not isinstance(value, list):
                problems.append(f"{path}: {kind}, got {type(value).__name__}")
                return
            for i, item in enumerate(value):
                _value(models, container.group(2), item, f"{path}[{i}]", problems)
        else:
            if not isinstance(value, dict):
                problems.append(f"{path}: {kind}, got {type(value).__name__}")
                return
            for k, item in value.items():
                _value(models, container.group(3), item, f"{path}[{k!r}]", problems)
        return
    ok = {
        "str": lambda v: isinstance(v, str),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "datetime": lambda v: isinstance(v, str) and bool(_RFC3339.match(v)),
        "date": lambda v: isinstance(v, str) and bool(_DATE.match(v)),
        "object": lambda v: True,
    }.get(kind)
    if ok is not None:
        if not ok(value):
            problems.append(f"{path}: {kind}, got {type(value).__name__} {value!r}")
    elif isinstance(getattr(models, kind, None), type):
        _model(models, getattr(models, kind), value, path, problems)
    else:
        problems.append(f"{path}: type {kind!r} is not handled by this checker")

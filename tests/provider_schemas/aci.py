"""ARM answers held to the Azure SDK's models.

A generated Azure model declares its JSON in `_attribute_map` (attribute -> wire key, where a
dotted key such as `properties.provisioningState` is nested, and type: `str`, `int`, `float`,
`bool`, `iso-8601`, `[T]`, `{T}` or another model) and its rules in `_validation`. The SDK's own
deserializer keeps what it knows and drops the rest; `check` walks a document over those maps
and refuses an unknown key, a value of the wrong type, a missing required member, or a value
outside the enum its constructor names (`Union[str, _models.ContainerGroupSku]`), then
deserializes it with the model's own `deserialize`.

`CONTAINER_GROUP`, `CONTAINER_GROUP_LIST` and `DEPLOYMENT` name the answers the ACI fake gives;
`check_error` is ARM's error envelope (`{"error": CloudErrorBody}`); `check_template_group` holds
the container group inside the ARM template the ACI worker deploys to the same model.
"""
from __future__ import annotations

import enum
import importlib
import inspect
import re
from functools import cache

from tests.provider_schemas import raise_on

CONTAINER_GROUP = ("azure.mgmt.containerinstance.models", "ContainerGroup")
CONTAINER_GROUP_LIST = ("azure.mgmt.containerinstance.models", "ContainerGroupListResult")
DEPLOYMENT = ("azure.mgmt.resource.resources.models", "DeploymentExtended")
_ERROR_BODY = ("azure.mgmt.containerinstance.models", "CloudErrorBody")
_TEMPLATE_ONLY = ("apiVersion", "dependsOn", "condition", "copy", "comments")
"""Keys of an ARM template resource that belong to the template language, not to the resource."""
_DOT = re.compile(r"(?<!\\)\.")


def check(model: tuple[str, str], body: dict) -> dict:
    """`body` held to the model (`CONTAINER_GROUP`, ...); returned unchanged."""
    package, name = model
    models = importlib.import_module(package)
    problems: list[str] = []
    _model(models, getattr(models, name), body, name, problems)
    raise_on(f"ARM {name}", problems)
    getattr(models, name).deserialize(body)  # and the SDK's own reader takes it
    return body


def check_error(body: dict) -> dict:
    """ARM's error envelope: `{"error": {"code", "message", ...}}`."""
    problems = [f"error envelope: unknown key {k!r}" for k in body if k != "error"]
    raise_on("ARM error", problems + ([] if "error" in body else ["error envelope: no 'error'"]))
    check(_ERROR_BODY, body["error"])
    return body


def check_template_group(resource: dict) -> dict:
    """A container group as an ARM template resource (its template-language keys set aside)."""
    return check(CONTAINER_GROUP, {k: v for k, v in resource.items() if k not in _TEMPLATE_ONLY})


@cache
def _tree(cls) -> dict:
    """The model's JSON as nested keys; a leaf is (attribute, type)."""
    tree: dict = {}
    for attr, spec in cls._attribute_map.items():
        *parents, leaf = [p.replace("\\.", ".") for p in _DOT.split(spec["key"])]
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = (attr, spec["type"])
    return tree


@cache
def _enum_values(cls, attr: str) -> tuple[str, ...] | None:
    """The values of the enum the constructor names for `attr`, or None where it names none."""
    param = inspect.signature(cls.__init__).parameters.get(attr)
    if param is None:
        return None
    models = importlib.import_module(cls.__module__.rsplit(".", 1)[0])
    for name in re.findall(r"_models\.(\w+)", str(param.annotation)):
        found = getattr(models, name, None)
        if isinstance(found, type) and issubclass(found, enum.Enum):
            return tuple(e.value for e in found)
    return None


def _model(models, cls, data, path: str, problems: list[str]) -> None:
    if not isinstance(data, dict):
        problems.append(f"{path}: {cls.__name__} is an object, got {type(data).__name__}")
        return
    for key, sub in (getattr(cls, "_subtype_map", None) or {}).items():
        found = sub.get(data.get(key))
        if found is None:
            problems.append(f"{path}.{key}: {data.get(key)!r} names no subtype of {cls.__name__}")
            return
        cls = getattr(models, found)
    tree = _tree(cls)
    _node(models, cls, tree, data, path, problems)
    for attr, rules in cls._validation.items():
        if rules.get("required") and _lookup(data, cls._attribute_map[attr]["key"]) is None:
            problems.append(f"{path}: {cls._attribute_map[attr]['key']} required by {cls.__name__}, missing")


def _lookup(data: dict, key: str):
    for part in (p.replace("\\.", ".") for p in _DOT.split(key)):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _node(models, cls, tree: dict, data: dict, path: str, problems: list[str]) -> None:
    for key, value in data.items():
        where = f"{path}.{key}"
        spec = tree.get(key)
        if spec is None:
            problems.append(f"{where}: not a member of {cls.__name__}")
        elif isinstance(spec, dict):
            if isinstance(value, dict):
                _node(models, cls, spec, value, where, problems)
            elif value is not None:
                problems.append(f"{where}: an object, got {type(value).__name__}")
        else:
            attr, kind = spec
            _value(models, kind, value, where, problems, _enum_values(cls, attr))


def _value(models, kind: str, value, path: str, problems: list[str], enum_values=None) -> None:
    from azure.mgmt.containerinstance._serialization import Deserializer

    if value is None:  # ARM writes null for an absent optional member; required ones are checked above
        return
    if kind.startswith(("[", "{")):
        container = list if kind.startswith("[") else dict
        if not isinstance(value, container):
            problems.append(f"{path}: {kind}, got {type(value).__name__}")
            return
        items = enumerate(value) if container is list else value.items()
        for k, item in items:
            _value(models, kind[1:-1], item, f"{path}[{k!r}]", problems, enum_values)
        return
    if kind == "str":
        if not isinstance(value, str):
            problems.append(f"{path}: str, got {type(value).__name__} {value!r}")
        elif enum_values and value not in enum_values:
            problems.append(f"{path}: {value!r} is not one of {list(enum_values)}")
    elif kind in ("int", "long"):
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{path}: {kind}, got {type(value).__name__} {value!r}")
    elif kind == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(f"{path}: float, got {type(value).__name__} {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            problems.append(f"{path}: bool, got {type(value).__name__} {value!r}")
    elif kind == "iso-8601":
        try:
            if not isinstance(value, str):
                raise TypeError(type(value).__name__)
            Deserializer.deserialize_iso(value)
        except Exception as exc:  # noqa: BLE001 - any refusal of the SDK's parser is the finding
            problems.append(f"{path}: an ISO-8601 time, got {value!r} ({exc})")
    elif kind == "object":
        pass
    elif isinstance(getattr(models, kind, None), type):
        _model(models, getattr(models, kind), value, path, problems)
    else:
        problems.append(f"{path}: type {kind!r} is not handled by this checker")

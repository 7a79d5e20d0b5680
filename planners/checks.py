"""Input checks for the planners' JSON documents: each failure names the field.

Every function takes the document (a dict), the field name and a `path` prefix for nested
fields (e.g. `layers[3].forward_s`), and returns the validated value or raises
`PlannerInputError`. Booleans are not numbers here, and non-finite numbers are refused.
"""
from __future__ import annotations

import math
from typing import Any

from core.errors import PlannerInputError

_MISSING = object()


def _name(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def field_value(doc: Any, field: str, path: str = "", default: Any = _MISSING) -> Any:
    """The raw value of `field` in `doc`; a missing required field is an error."""
    name = _name(path, field)
    if not isinstance(doc, dict):
        raise PlannerInputError(path or "input", "must be a JSON object")
    if field not in doc or doc[field] is None:
        if default is _MISSING:
            raise PlannerInputError(name, "is required")
        return default
    return doc[field]


def number(doc: Any, field: str, path: str = "", *, positive: bool = False,
           non_negative: bool = False, minimum: float | None = None,
           default: Any = _MISSING) -> float:
    """A finite number, optionally > 0, >= 0 or >= `minimum`."""
    value = field_value(doc, field, path, default)
    name = _name(path, field)
    return check_number(value, name, positive=positive, non_negative=non_negative, minimum=minimum)


def check_number(value: Any, name: str, *, positive: bool = False, non_negative: bool = False,
                 minimum: float | None = None) -> float:
    """Check an already-extracted value (see `number`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlannerInputError(name, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise PlannerInputError(name, "must be finite")
    if positive and value <= 0:
        raise PlannerInputError(name, f"must be > 0, got {value}")
    if non_negative and value < 0:
        raise PlannerInputError(name, f"must be >= 0, got {value}")
    if minimum is not None and value < minimum:
        raise PlannerInputError(name, f"must be >= {minimum}, got {value}")
    return float(value)


def integer(doc: Any, field: str, path: str = "", *, minimum: int | None = None,
            default: Any = _MISSING) -> int:
    """A whole number (an integral float such as 4.0 is accepted), optionally >= `minimum`."""
    value = field_value(doc, field, path, default)
    return check_integer(value, _name(path, field), minimum=minimum)


def check_integer(value: Any, name: str, *, minimum: int | None = None) -> int:
    """Check an already-extracted value (see `integer`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlannerInputError(name, f"must be an integer, got {type(value).__name__}")
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise PlannerInputError(name, f"must be an integer, got {value}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise PlannerInputError(name, f"must be >= {minimum}, got {value}")
    return value


def array(doc: Any, field: str, path: str = "", *, non_empty: bool = True,
          length: int | None = None, default: Any = _MISSING) -> list:
    """A JSON list, optionally non-empty or of an exact length."""
    value = field_value(doc, field, path, default)
    name = _name(path, field)
    if not isinstance(value, list):
        raise PlannerInputError(name, f"must be a list, got {type(value).__name__}")
    if non_empty and not value:
        raise PlannerInputError(name, "must not be empty")
    if length is not None and len(value) != length:
        raise PlannerInputError(name, f"must have {length} entries, got {len(value)}")
    return value


def choice(doc: Any, field: str, options: tuple[str, ...], path: str = "",
           default: Any = _MISSING) -> str:
    """One of `options`."""
    value = field_value(doc, field, path, default)
    if value not in options:
        raise PlannerInputError(_name(path, field), f"must be one of {', '.join(options)}, got {value!r}")
    return value

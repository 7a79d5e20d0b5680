"""What a user names by import path: a model factory, a dataset loader or a loss, each given as
`package.module:function` and imported here, the one place that turns such a name into a Python
callable. Standard-library names are refused (`os:system` is no model), and every refusal is a
`ZooidValueError` naming the job field the path came from."""
from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable

from core.errors import ZooidValueError


def import_callable(path: str, field: str, what: str, form: str = "function",
                    allow_class: bool = False) -> Callable[..., Any]:
    """The Python callable `path` (`package.module:function`) names, imported and checked, not
    called; ZooidValueError(`field`, ...) naming `what` it should be (`a model factory`, `a
    callable loader`, `a loss function`) when the path is malformed, in the standard library,
    cannot be imported, lacks the attribute, or names no Python callable (a builtin; a class too
    unless `allow_class`, as a model class is its own factory). `form`: the word after
    `package.module:` in the malformed-path message."""
    module_name, _, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not module_name or not attr:
        raise ZooidValueError(field, f"{path!r} is not `package.module:{form}`")
    if module_name.split(".")[0] in sys.stdlib_module_names:
        raise ZooidValueError(field, f"{path!r} is in the standard library, not {what}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ZooidValueError(field, f"cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ZooidValueError(field, f"{module_name!r} has no attribute {attr!r}")
    if not callable(fn) or inspect.isbuiltin(fn) or (inspect.isclass(fn) and not allow_class):
        raise ZooidValueError(field, f"{path!r} is not {what} (not a Python function)")
    return fn

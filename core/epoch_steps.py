"""How many steps an epoch takes: the one rule the planners (which may import only core) and
the workers' sample order (`engine.epoch_order`, whose docstring derives it) share."""
from __future__ import annotations

from core.errors import ZooidValueError


def epoch_steps(n: int, world: int, batch: int) -> int:
    """Steps every replica takes when `world` replicas with batches of `batch` share `n` samples:
    the full steps of `world * batch`, plus one for a tail of at least `world` samples (or when
    there is no full step); a shorter tail joins the last batches, one sample each."""
    for name, value in (("world", world), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ZooidValueError(name, f"must be a positive integer, got {value!r}")
    full, tail = divmod(n, world * batch)
    return full + (1 if tail and (tail >= world or full == 0) else 0)

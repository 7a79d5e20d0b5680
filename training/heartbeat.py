"""A worker's heartbeat: proof of progress that a hung worker stops giving.

The coordinator sets `ZOOID_HEARTBEAT=<file>` for each inline worker; `beat()` touches that
file at most once a second. The training loop beats after every optimizer step and a store
wait beats while it polls, so a worker blocked at a sync on a dead peer stays alive in the
coordinator's eyes, and only the worker that really stopped (a hang, a deadlock) goes quiet
until its timeout fires. Without the variable, `beat()` does nothing.
"""
from __future__ import annotations

import os
import time

ENV = "ZOOID_HEARTBEAT"
_last = 0.0


def beat() -> None:
    """Record progress (throttled to one touch a second)."""
    global _last
    path = os.environ.get(ENV)
    if not path:
        return
    now = time.monotonic()
    if now - _last < 1.0:
        return
    _last = now
    try:
        os.utime(path)
    except FileNotFoundError:
        open(path, "ab").close()


def last_beat(path: str) -> float | None:
    """Unix time of the last beat written to `path`, or None."""
    try:
        return os.path.getmtime(path)
    except OSError:
        return None

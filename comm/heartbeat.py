"""A worker's heartbeat: proof of progress that a hung worker stops giving.

The training loop calls `step()` after every optimizer step (or pipeline iteration) and a
store wait calls `beat()` while it polls, so a worker blocked at a sync on a dead peer
stays alive in the coordinator's eyes, and only the worker that really stopped (a hang, a
deadlock) goes quiet until its timeout fires.

Where the beat goes:
- `ZOOID_HEARTBEAT=<file>` (set by the coordinator for each inline worker): the file is
  touched at most once a second;
- in every process: `progress()` returns the steps done and the time of the last beat,
  which a warm worker publishes in the store for the coordinator (`runtime.warm`);
- a guard (`set_guard`) runs on every beat of the thread that installed it: a warm worker
  uses it to stop its epoch where the training thread is, when its lease has expired;
- a wait guard (`set_wait_guard`) runs on the beats of a store wait (`beat(waiting=True)`) in
  the thread that installed it: a replica that got the provider's notice while it waits at a
  sync for a peer leaves from there (`engine.preemption.stop_waiting`) instead of waiting
  through its grace into the SIGKILL.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

ENV = "ZOOID_HEARTBEAT"
_last = 0.0
_steps = 0
_beat_at = 0.0
_guard: tuple[int, Callable[[], None]] | None = None
_wait_guard: tuple[int, Callable[[], None]] | None = None


def beat(waiting: bool = False) -> None:
    """Record progress (the file is touched at most once a second); `waiting`: a store wait's
    beat, which also runs the wait guard."""
    global _last, _beat_at
    _beat_at = time.time()
    if _guard is not None and _guard[0] == threading.get_ident():
        _guard[1]()
    if waiting and _wait_guard is not None and _wait_guard[0] == threading.get_ident():
        _wait_guard[1]()
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


def step() -> None:
    """Count one training step and beat."""
    global _steps
    _steps += 1
    beat()


def progress() -> tuple[int, float]:
    """(steps counted since `reset_steps`, Unix time of the last beat; 0 before any)."""
    return _steps, _beat_at


def reset_steps() -> None:
    """Start counting steps afresh (a warm worker does this at every epoch)."""
    global _steps, _beat_at
    _steps, _beat_at = 0, time.time()


def set_guard(check: Callable[[], None] | None) -> None:
    """Run `check` on every beat made by the calling thread (None removes it); `check`
    raises to stop the work in progress."""
    global _guard
    _guard = None if check is None else (threading.get_ident(), check)


def set_wait_guard(check: Callable[[], None] | None) -> None:
    """Run `check` on every beat of a store wait in the calling thread (None removes it);
    `check` raises to stop the wait."""
    global _wait_guard
    _wait_guard = None if check is None else (threading.get_ident(), check)


def last_beat(path: str) -> float | None:
    """Unix time of the last beat written to `path`, or None."""
    try:
        return os.path.getmtime(path)
    except OSError:
        return None

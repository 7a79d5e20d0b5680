"""Retry policy shared by Zooid's tasks: back off on transient errors, never retry the rest.

A validation error, an out-of-memory, unreadable data or a cancelled run is not transient: retrying would fail
the same way (or spend money twice), so `retry_transient` refuses those.
"""
from __future__ import annotations

from core.errors import DataError, OutOfMemory, ZooidValueError

BACKOFF_S = [2.0, 8.0, 30.0]
"""Delays before the first, second and third retry (exponential-ish)."""

NOT_TRANSIENT = (ZooidValueError, ValueError, TypeError, OutOfMemory, DataError, KeyboardInterrupt)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying could help: anything but bad input, OOM, unreadable data and programming errors."""
    return not isinstance(exc, NOT_TRANSIENT)


def retry_transient(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry only when the failure was transient."""
    try:
        state.result()
    except BaseException as exc:  # the state's exception, re-raised
        return is_transient(exc)
    return True


def task_options(*, retries: int = 2, timeout_s: float = 600.0) -> dict:
    """Keyword arguments for `@task` with Zooid's retry policy and a timeout."""
    return dict(retries=retries, retry_delay_seconds=BACKOFF_S[:max(retries, 1)],
                retry_jitter_factor=0.2, retry_condition_fn=retry_transient,
                timeout_seconds=timeout_s, persist_result=False)

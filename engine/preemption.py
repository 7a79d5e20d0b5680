"""The provider's notice: a worker on spot capacity gets SIGTERM some seconds (the grace)
before the SIGKILL that takes it back, and leaves cleanly inside that grace.

`listening()` is the epoch's SIGTERM handler (`runtime.run_spec` wraps every epoch in it): the
handler only sets a flag, and the training loop looks at it at each step boundary
(`requested()`). What the worker then hands over is its engine's business: a Local-SGD replica
writes a handover checkpoint of its own state and position (`engine.local_sgd_epoch`), which
its replacement continues from, so nothing else is lost; a pipeline stage has nothing a new
stage could take and leaves at once, so that its attempt is rerun now rather than after a
timeout. Either way it writes a marker (`mark_preempted`, `core.keys.preempted_marker_key`)
and raises `core.errors.Preempted` (exit status 6 from `runtime.worker_main`; a flow run that
ends Failed with it), which the coordinator classifies as `preempted`
(`coordinator.workers.failures`): retried on new capacity, never counted as a crash.

The handler is installed in the main thread only (Python delivers signals there); it replaces
whatever handler was in force (in a `worker` flow run, Prefect's, which would raise
`TerminationSignal` and crash the flow run) for the epoch and puts it back after. Where the
epoch runs in another thread, nothing is installed there: the process-wide handler below, in
the main thread, sets the same flag while any `listening()` block is open.

Working through the notice (`overlapping`): a warm worker whose pool starts a successor at the
notice (`runtime.warm`, `coordinator.workers.warm_pool`) keeps working instead of leaving:
`due()` says to hand over only once the pool releases it (its successor is ready) or the
notice's working time (`core.notice.work_through_s`) is spent, and a wait for a peer ends on the
notice only then. A second SIGTERM means leave now.

Outside an epoch the notice can come at any moment too: while a worker starts (imports torch,
builds the model), profiles, or waits warm for its next command. There is nothing to hand over
then, so the worker leaves at once. `leaving(hook)` installs the process-wide handler for its
block, as early as the worker's own code runs (`runtime.worker_main.main`, the `worker` flow,
`runtime.warm.serve`): during an epoch it defers to `listening()`'s flag; otherwise it runs the
innermost scopes' hooks (a warm worker marks itself preempted where its pool can read it, at
most `HOOK_S` seconds) and exits at once with `EXIT_STATUS`. It matters in a container, where
the worker's process is the namespace's init (PID 1): the kernel does not deliver a signal whose
disposition is the default to PID 1, so without a handler the notice is ignored and the engine
SIGKILLs the container at the end of the grace.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from comm.store import Store
from core.errors import Preempted, ZooidError
from core.keys import preempted_marker_key
from core.specs import WorkerSpec

_noticed_at = 0.0
"""Unix time of the notice this epoch got (0: none)."""

EXIT_STATUS = 6
"""The exit status of a worker that got the notice and left (`runtime.worker_main` gives
`Preempted` the same; `coordinator.workers.failures.EXIT_PREEMPTED`)."""

HOOK_S = 5.0
"""The longest the hooks of `leaving()` may take before the worker exits anyway."""

_listening = 0
"""How many `listening()` blocks are open (an epoch in progress, in any thread)."""

_leave_hooks: list[Callable[[], None]] = []
"""What to do before leaving at once (`leaving`), innermost last."""


_overlap: tuple[float, Callable[[], bool]] | None = None
"""While `overlapping()`: the notice's working seconds and whether the pool released the worker."""


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    """Only set the flag: the training loop acts at its next step boundary."""
    global _noticed_at
    if not _noticed_at:
        _noticed_at = time.time()


WAIT_AFTER_NOTICE_S = 2.0
"""How long, after the notice, the worker waits for peers before it leaves from the wait
(`stop_waiting`): a peer that answers within it is alive and the round completes, so the
worker hands over after it and nothing is redone; one that does not is gone or its
replacement still starting, and waiting on would run into the SIGKILL. Well inside every
grace the catalog lists (30 s to 120 s) and the 10 s the spot benchmark gives."""


class NoticeWhileWaiting(ZooidError):
    """The notice came while the training thread waited in the store for a peer (a sync's
    pieces from a rank that is gone) and the wait went on `WAIT_AFTER_NOTICE_S`: raised from
    the wait by `stop_waiting`, for the epoch to leave from there."""


_waiting_since = 0.0
"""Unix time of the first wait guard's call after this epoch's notice (0: none yet)."""


def stop_waiting() -> None:
    """A wait guard (`comm.heartbeat.set_wait_guard`): once the notice came, raise
    `NoticeWhileWaiting` when the worker has waited `WAIT_AFTER_NOTICE_S` for peers since
    (working through the notice: once its working time is spent, `due`)."""
    global _waiting_since
    if not _noticed_at:
        return
    if _overlap is not None:
        if time.time() >= _noticed_at + _overlap[0]:
            raise NoticeWhileWaiting()
        return
    now = time.time()
    _waiting_since = _waiting_since or now
    if now - _waiting_since >= WAIT_AFTER_NOTICE_S:
        raise NoticeWhileWaiting()


def requested() -> bool:
    """Whether the notice came during this epoch."""
    return bool(_noticed_at)


def due() -> bool:
    """Whether to hand over (or leave) now: the notice came and, working through it
    (`overlapping`), the pool released this worker or the notice's working time is spent."""
    if not _noticed_at:
        return False
    if _overlap is None:
        return True
    work_s, released = _overlap
    return time.time() >= _noticed_at + work_s or bool(released())


@contextmanager
def overlapping(work_s: float, released: Callable[[], bool]) -> Iterator[None]:
    """For the block, the notice does not make the worker leave at once (module docstring):
    it works on for up to `work_s` seconds (`core.notice.work_through_s`) or until
    `released()` (called at step boundaries and between commands; pace its reads) is true.
    With `work_s` 0 the block changes nothing."""
    global _overlap
    if work_s <= 0:
        yield
        return
    previous, _overlap = _overlap, (float(work_s), released)
    try:
        yield
    finally:
        _overlap = previous


def noticed_at() -> float:
    """Unix time the notice came (0: none)."""
    return _noticed_at


def reset() -> None:
    """Forget a notice (a new epoch, or a test)."""
    global _noticed_at, _waiting_since
    _noticed_at = _waiting_since = 0.0


@contextmanager
def listening() -> Iterator[bool]:
    """SIGTERM sets the flag for the duration of the block (installed in the main thread; from
    another thread, the process-wide handler of `leaving()` sets it); the handler in force before
    is restored after. Yields whether the handler is installed."""
    global _listening, _waiting_since
    if _overlap is None:
        reset()
    else:  # a notice that came while the worker was idle: it still stands
        _waiting_since = 0.0
    _listening += 1
    try:
        if threading.current_thread() is not threading.main_thread():
            yield False
            return
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            yield True
        finally:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    finally:
        _listening -= 1


def _on_notice(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    """The process-wide handler: during an epoch, the epoch's flag; working through the notice
    (`overlapping`), the flag too, and a second notice leaves at once; otherwise leave at once."""
    if _listening or (_overlap is not None and not _noticed_at):
        _on_sigterm(signum, frame)
        return
    leave_now()


def leave_now(status: int = EXIT_STATUS, why: str = "the notice came outside an epoch") -> None:
    """Leave at once with nothing (more) to hand over: run the hooks of the open `leaving()` blocks,
    innermost first (in a thread, at most `HOOK_S` seconds in all: a store that hangs must not
    outlast the grace), flush the output and exit the process with `status`."""
    global _noticed_at
    if not _noticed_at:
        _noticed_at = time.time()
    hooks = list(reversed(_leave_hooks))

    def run_hooks() -> None:
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # leave anyway: the exit status still says why
                print(f"zooid: on the notice, {getattr(hook, '__name__', 'a hook')} failed: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)

    if hooks:
        runner = threading.Thread(target=run_hooks, name="zooid-notice", daemon=True)
        runner.start()
        runner.join(HOOK_S)
    print(f"zooid: {why} (pid {os.getpid()}); leaving now", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


@contextmanager
def leaving(hook: Callable[[], None] | None = None) -> Iterator[bool]:
    """The process-wide notice handler for the block (main thread only; the one in force before
    is restored after): a SIGTERM during an epoch (`listening()`) sets its flag, any other
    leaves at once (`leave_now`) after `hook()` and the hooks of the blocks around this one.
    Yields whether the handler is installed."""
    if hook is not None:
        _leave_hooks.append(hook)
    previous, installed = None, threading.current_thread() is threading.main_thread()
    if installed:
        previous = signal.signal(signal.SIGTERM, _on_notice)
    try:
        yield installed
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if hook is not None:
            _leave_hooks.remove(hook)


def mark_preempted(store: Store | None, spec: WorkerSpec, step: int, handover: str = "", **extra) -> dict:
    """Write the preempted marker of this attempt (`read_preempted_marker`): the step boundary
    it left at, the handover checkpoint's key ("" when its protocol hands nothing over), when
    the notice came and when it left. Returns the marker."""
    marker = {"kind": "preempted", "run_id": spec.run_id, "epoch": spec.epoch, "rank": spec.rank,
              "attempt": spec.attempt, "capacity": spec.capacity, "step": step, "handover": handover,
              "noticed_at": _noticed_at or time.time(), "left_at": time.time(), "pid": os.getpid(), **extra}
    if store is not None:
        store.put(preempted_marker_key(spec.run_id, spec.epoch, spec.rank, spec.attempt), json.dumps(marker).encode())
    return marker


def read_preempted_marker(store: Store, run_id: str, epoch: int, rank: int, attempt: int) -> dict | None:
    """The marker of a worker attempt that left on notice, or None."""
    try:
        return json.loads(store.get(preempted_marker_key(run_id, epoch, rank, attempt)))
    except KeyError:
        return None


def leave(store: Store | None, spec: WorkerSpec, step: int, handover: str = "", **extra) -> None:
    """Mark this attempt preempted and raise `Preempted`."""
    mark_preempted(store, spec, step, handover, **extra)
    what = f"handed over at step {step}" if handover else f"left at step {step} with nothing to hand over"
    raise Preempted(f"rank {spec.rank} of epoch {spec.epoch} got the notice and {what}")

"""Fault injection for tests and drills: off unless `ZOOID_CHAOS` is set.

`ZOOID_CHAOS` holds comma-separated faults, each `KIND[:key=value]...`:

| kind | what the worker does |
|---|---|
| `kill_worker` | SIGKILLs itself (exit -9, 137 in a shell): a lost container |
| `crash_worker` | `os._exit(17)`: dies without cleanup or result |
| `hang_worker` | sleeps forever, so the coordinator's worker timeout has to fire |
| `oom_worker` | `mode=alloc` (default): caps its address space and allocates until a real `MemoryError`, reported as `OutOfMemory` (exit 4); `mode=kill`: SIGKILLs itself as the kernel's OOM killer would |
| `slow_worker` | sleeps `seconds=S` (default 2) and goes on: a straggler, not a failure |
| `preempt_worker` | the provider's notice: sends itself SIGTERM and forks a watcher that SIGKILLs it `grace=G` seconds later (default 2; `grace=0`: SIGKILL only, no notice), as `podman stop -t G` does; the worker hands over and leaves (`engine.preemption`). `at=sync` fires at the start of the first sync at or after step S (the notice comes during the collective), `at=profile` when the worker starts a profile command (`runtime.warm`) |
| `hold_worker` | waits until a key under `runs/<run_id>/` starting with `until=PREFIX` exists in its store (at most `seconds=S`, default 600), then goes on: an epoch held open until an event elsewhere, e.g. `until=warm/r1-` (a warm worker of rank 1 has started); it first writes `runs/<run_id>/faults/held-e<epoch>-r<rank>-a<attempt>.json`, an event a test can wait on |

Keys select where it fires: `epoch=E`, `rank=R` (default: any), `attempt=A` or `attempt=any`
(default 0, so a relaunch succeeds; `crash_worker` keeps its original meaning, every
attempt, unless `attempt=` is given), `step=S` (fire before optimizer step S, 0-based,
that is after S steps; default: at worker start) and `at=sync` (fire right after the
first sync point at or after step S, once its checkpoint is written). Example:
`ZOOID_CHAOS=kill_worker:epoch=1:rank=0:step=5,hang_worker:epoch=2:rank=1:at=sync`.

Before a fault that ends the worker fires, it writes a marker
`runs/<run_id>/faults/e<epoch>-r<rank>-a<attempt>.json` = `{kind, step, time, ...}` to the
store, so the coordinator can tell an injected failure from a real one
(`read_fault_marker`). Faults act on the whole process: run workers as processes
(`python -m runtime.worker_main`) when injecting them.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import time
from dataclasses import dataclass

from comm import heartbeat
from comm.store import Store
from engine import preemption
from core.errors import OutOfMemory, ZooidValueError
from core.keys import fault_marker_key, held_marker_key, run_key
from core.specs import WorkerSpec

ENV = "ZOOID_CHAOS"
KINDS = ("kill_worker", "crash_worker", "hang_worker", "oom_worker", "slow_worker", "hold_worker", "preempt_worker")
CRASH_EXIT = 17
"""Exit status of an injected `crash_worker`."""


class ChaosError(ZooidValueError):
    """A `ZOOID_CHAOS` value that does not parse."""

    def __init__(self, message: str):
        super().__init__(ENV, message)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One parsed fault of `ZOOID_CHAOS`."""

    kind: str
    epoch: int | None = None
    """Epoch it fires in; None: any."""
    rank: int | None = None
    """Rank it fires on; None: any."""
    attempt: int | None = 0
    """Attempt it fires on; None: every attempt."""
    step: int | None = None
    """Fire before this 0-based step (or at the first sync at or after it); None: at start."""
    at: str = "step"
    """`step` or `sync`."""
    mode: str = "alloc"
    """`oom_worker` only: `alloc` (a real MemoryError) or `kill` (SIGKILL)."""
    seconds: float = 2.0
    """`slow_worker`: how long to stall; `hold_worker`: the longest it waits."""
    until: str = ""
    """`hold_worker` only: the key prefix (below `runs/<run_id>/`) whose appearance releases it."""
    grace: float = 2.0
    """`preempt_worker` only: seconds from the SIGTERM to the SIGKILL (0: SIGKILL only)."""

    def matches(self, spec: WorkerSpec) -> bool:
        """Whether this fault targets `spec`'s epoch, rank and attempt."""
        return all(want is None or want == have for want, have in
                   ((self.epoch, spec.epoch), (self.rank, spec.rank), (self.attempt, spec.attempt)))


def _int(key: str, value: str, item: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ChaosError(f"{key}={value!r} in {item!r} is not an integer") from None
    if number < 0:
        raise ChaosError(f"{key}={value!r} in {item!r} must be >= 0")
    return number


def parse_chaos(text: str) -> list[Fault]:
    """Parse a `ZOOID_CHAOS` value (see the module docstring); '' gives no faults."""
    faults = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ChaosError(f"unknown fault {kind!r} in {item!r}; use one of {', '.join(KINDS)}")
        fields: dict = {"kind": kind, "attempt": None if kind == "crash_worker" else 0}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ChaosError(f"{pair!r} in {item!r} is not key=value")
            if key in ("epoch", "rank", "step"):
                fields[key] = _int(key, value, item)
            elif key == "attempt":
                fields[key] = None if value in ("any", "*") else _int(key, value, item)
            elif key == "at" and (value in ("step", "sync") or (value == "profile" and kind == "preempt_worker")):
                fields[key] = value
            elif key == "grace" and kind == "preempt_worker":
                try:
                    fields[key] = float(value)
                except ValueError:
                    raise ChaosError(f"grace={value!r} in {item!r} is not a number") from None
                if fields[key] < 0:
                    raise ChaosError(f"grace={value!r} in {item!r} must be >= 0")
            elif key == "mode" and kind == "oom_worker" and value in ("alloc", "kill"):
                fields[key] = value
            elif key == "until" and kind == "hold_worker" and value:
                fields[key] = value
            elif key == "seconds" and kind in ("slow_worker", "hold_worker"):
                try:
                    fields[key] = float(value)
                except ValueError:
                    raise ChaosError(f"seconds={value!r} in {item!r} is not a number") from None
            else:
                raise ChaosError(f"{pair!r} is not a valid setting of {kind} in {item!r}")
        if kind == "hold_worker" and "until" not in fields:
            raise ChaosError(f"hold_worker needs until=PREFIX in {item!r}")
        fields.setdefault("seconds", 600.0 if kind == "hold_worker" else 2.0)
        faults.append(Fault(**fields))
    return faults


def read_fault_marker(store: Store, run_id: str, epoch: int, rank: int, attempt: int) -> dict | None:
    """The marker of an injected fault of that worker attempt, or None when it was not injected."""
    try:
        return json.loads(store.get(fault_marker_key(run_id, epoch, rank, attempt)))
    except KeyError:
        return None


class Chaos:
    """The faults aimed at one worker, with hooks the engine calls at start, before each
    step and after each sync. With `ZOOID_CHAOS` unset every hook is a no-op."""

    def __init__(self, spec: WorkerSpec, store: Store | None, faults: list[Fault]):
        self.spec, self.store = spec, store
        self.pending = [f for f in faults if f.matches(spec)]

    def at_start(self) -> None:
        """Fire the faults that have no step."""
        for f in [f for f in self.pending if f.step is None and f.at == "step"]:
            self._fire(f, 0)

    def before_step(self, step: int) -> None:
        """Fire the faults due before 0-based step `step`."""
        for f in [f for f in self.pending if f.at == "step" and f.step == step]:
            self._fire(f, step)

    def after_sync(self, step: int) -> None:
        """Fire the `at=sync` faults due at a sync reached after `step` steps."""
        for f in [f for f in self.pending if f.at == "sync" and (f.step or 0) <= step
                  and f.kind != "preempt_worker"]:
            self._fire(f, step)

    def during_sync(self, step: int) -> None:
        """Fire the `at=sync` preemptions due at a sync that starts after `step` steps: the
        notice comes while the collective runs."""
        for f in [f for f in self.pending if f.at == "sync" and (f.step or 0) <= step and f.kind == "preempt_worker"]:
            self._fire(f, step)

    def at_profile(self) -> None:
        """Fire the `at=profile` faults: a profile command starts."""
        for f in [f for f in self.pending if f.at == "profile"]:
            self._fire(f, 0)

    def _fire(self, fault: Fault, step: int) -> None:
        self.pending.remove(fault)
        if fault.kind == "slow_worker":
            time.sleep(fault.seconds)
            return
        if fault.kind == "hold_worker":
            self._hold(fault)
            return
        if fault.kind == "preempt_worker":  # the watcher first: its pid goes into the marker
            watcher = watch_and_kill(os.getpid(), fault.grace) if fault.grace > 0 else None
            self._mark(fault, step, watcher=watcher)
            os.kill(os.getpid(), signal.SIGTERM if fault.grace > 0 else signal.SIGKILL)
            return
        self._mark(fault, step)
        if fault.kind == "kill_worker" or (fault.kind == "oom_worker" and fault.mode == "kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "crash_worker":
            os._exit(CRASH_EXIT)
        if fault.kind == "hang_worker":
            while True:
                time.sleep(3600)
        exhaust_memory()

    def _hold(self, fault: Fault, poll_s: float = 0.05) -> None:
        """Wait for a key starting with `runs/<run_id>/<until>` (polling the store), at most
        `fault.seconds`, or until the provider's notice comes (`engine.preemption`: a held
        worker leaves as a training one would)."""
        if self.store is None:
            raise ChaosError("hold_worker needs the worker's store")
        s = self.spec
        self.store.put(held_marker_key(s.run_id, s.epoch, s.rank, s.attempt),  # an event to wait on
                       json.dumps({"kind": fault.kind, "until": fault.until, "time": time.time(),
                                   "pid": os.getpid()}).encode())
        prefix, give_up = run_key(s.run_id, fault.until), time.monotonic() + fault.seconds
        while not self.store.list(prefix) and not preemption.due() and time.monotonic() < give_up:
            heartbeat.beat()  # held on purpose, not hanging
            time.sleep(poll_s)

    def _mark(self, fault: Fault, step: int, **extra) -> None:
        if self.store is None:
            return
        s = self.spec
        marker = {"kind": fault.kind, "step": step, "time": time.time(), "run_id": s.run_id,
                  "epoch": s.epoch, "rank": s.rank, "attempt": s.attempt, "pid": os.getpid(),
                  **({"grace": fault.grace, "at": fault.at} if fault.kind == "preempt_worker" else {}), **extra}
        self.store.put(fault_marker_key(s.run_id, s.epoch, s.rank, s.attempt),
                       json.dumps(marker).encode())


def preempt(pid: int, grace_s: float, poll_s: float = 0.02) -> None:
    """What a provider does to take a worker back: SIGTERM to `pid`, then SIGKILL `grace_s`
    seconds later if it still runs (`grace_s` 0: SIGKILL at once, no notice). The SIGKILL comes
    from a forked watcher, so a main thread that hangs after the notice is still killed; the
    watcher ends as soon as `pid` is gone (or its parent, when `pid` is its parent)."""
    if grace_s <= 0:
        os.kill(pid, signal.SIGKILL)
        return
    watch_and_kill(pid, grace_s, poll_s)
    os.kill(pid, signal.SIGTERM)


def watch_and_kill(pid: int, grace_s: float, poll_s: float = 0.02) -> int:
    """Fork a watcher that SIGKILLs `pid` in `grace_s` seconds unless it ended first; return
    the watcher's pid. It ends as soon as `pid` is gone (or its parent, when `pid` is its parent)."""
    child = os.fork()
    if child == 0:  # the watcher: no locks, no Python-level state touched, only sleeps and kills
        try:
            parent = os.getppid()
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                if (pid == parent and os.getppid() != parent) or not _alive(pid):
                    os._exit(0)
                time.sleep(poll_s)
            os.kill(pid, signal.SIGKILL)
        except BaseException:  # noqa: BLE001 - the watcher never returns into the worker's code
            pass
        os._exit(0)
    return child


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exhaust_memory(headroom_bytes: int = 256 << 20) -> None:
    """Cap this process's address space a little above its current size, allocate until a
    real MemoryError, and raise it as `OutOfMemory`. Capping first keeps the fault from
    starving other processes on the machine."""
    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    saved = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_kb * 1024 + headroom_bytes, saved[1]))
    hoard = []
    try:
        while True:
            hoard.append(bytearray(16 << 20))
    except MemoryError as exc:
        n = len(hoard)
        hoard.clear()
        raise OutOfMemory(f"MemoryError after {n} x 16 MiB (injected oom_worker): {exc!r}") from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, saved)


def chaos_for(spec: WorkerSpec, store: Store | None = None) -> Chaos:
    """The faults `ZOOID_CHAOS` aims at this worker (raises ChaosError if it does not parse)."""
    return Chaos(spec, store, parse_chaos(os.environ.get(ENV, "")))


def chaos_requested(spec: WorkerSpec) -> str | None:
    """The kind of the first fault `ZOOID_CHAOS` aims at this worker, if any."""
    chaos = chaos_for(spec)
    return chaos.pending[0].kind if chaos.pending else None

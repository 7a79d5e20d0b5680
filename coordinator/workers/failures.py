"""Classify a failed worker before anyone retries it (pure: no Prefect, no store).

Evidence, strongest first:

1. an injected-fault marker (`engine.chaos.read_fault_marker`): `injected`, retried;
   except an injected `oom_worker`, which is classified as a real OOM (with
   `injected=True`) so that the coordinator's no-retry path can be drilled, and an injected
   `preempt_worker`, which is `preempted` (with `injected=True`);
1b. a preempted marker (`engine.preemption.read_preempted_marker`: the worker got the
   provider's notice and left, after its handover), exit 6 (`Preempted`), or a SIGTERM's
   status (-15 / 143: a notice with no handler, or nothing to hand over), or Prefect's own
   crash message for a termination signal (a flow run stopped before the worker's handler was
   in place): `preempted`, retried on new capacity and never counted as a crash;
2. the coordinator's own timeout fired: `timeout`, retried;
3. bad input: exit 2 or a `ZooidValueError` line: `bad_input`, never retried;
3b. unreadable data: exit 7 or a `ShardError` / `DataError` line (a dataset shard missing or
   corrupt after the worker's own reads, `engine.shards`): `data`, never retried (another
   attempt reads the same bytes; the dataset must be prepared again);
4. out of memory: exit 4 (the worker's `OutOfMemory`), `MemoryError`, CUDA
   `out of memory` / `OutOfMemoryError` text, or a SIGKILL (exit -9 / 137) together with
   an `oom_kill` increase in the cgroup's `memory.events` or a peak RSS (`VmHWM`) within
   5 % of the known memory limit: `oom`, never retried (re-plan with more memory or a
   smaller batch instead);
5. a store timeout: exit 3 or `StoreTimeout` text: `store_timeout`, retried (relaunch
   from the last sync checkpoint);
6. anything else: `crash`, retried.

Where the coordinator read no exit status (a flow run that Prefect already shows crashed), the
one Prefect's worker reports in its crash message (`PREFECT_EXIT_TEXT`) stands for it.

A SIGKILL without memory evidence is a crash: the kernel's OOM killer leaves its trace in
`memory.events`, so read the counters before launch and after exit (`read_memory_events`).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

from core.errors import ZooidValueError

OOM_TEXT = re.compile(r"MemoryError|OutOfMemory|out of memory|Cannot allocate memory|"
                      r"can't allocate memory", re.IGNORECASE)
BAD_INPUT_TEXT = re.compile(r"\bZooidValueError\b|\bStoreKeyError\b|\bChaosError\b")
STORE_TIMEOUT_TEXT = re.compile(r"\bStoreTimeout\b")
DATA_TEXT = re.compile(r"\b(?:ShardError|DataError): (.+)")
SIGKILL_CODES = (-9, 137)
SIGTERM_CODES = (-15, 143)
EXIT_PREEMPTED = 6
"""The exit status `runtime.worker_main` gives `Preempted`."""
PREEMPTED_TEXT = re.compile(r"\bPreempted\b")
SIGTERM_TEXT = re.compile(r"aborted by a termination signal")
"""Prefect's Crashed message for a flow run that a SIGTERM ended (`prefect.states`)."""
PREFECT_EXIT_TEXT = re.compile(r"infrastructure exited with non-zero status code (-?\d+)")
"""The Crashed message a Prefect worker gives a flow run whose container or process exited
before the flow run reached a final state (`prefect.workers.base`)."""
EXIT_BAD_INPUT, EXIT_STORE_TIMEOUT, EXIT_OOM, EXIT_DATA = 2, 3, 4, 7
"""The exit statuses `runtime.worker_main` gives these errors."""
NEAR_LIMIT = 0.95


class FailureKind(str, enum.Enum):
    """Why a worker attempt failed."""

    OOM = "oom"
    CRASH = "crash"
    TIMEOUT = "timeout"
    INJECTED = "injected"
    BAD_INPUT = "bad_input"
    STORE_TIMEOUT = "store_timeout"
    PREEMPTED = "preempted"
    DATA = "data"


NOT_RETRYABLE = frozenset({FailureKind.OOM, FailureKind.BAD_INPUT, FailureKind.DATA})


@dataclass(frozen=True)
class Failure:
    """A classified failure: its kind, whether a retry can help, and the evidence."""

    kind: FailureKind
    reason: str
    injected: bool = False
    """Whether a `ZOOID_CHAOS` fault caused it."""

    @property
    def retryable(self) -> bool:
        """False for `oom`, `bad_input` and `data`: a retry would fail the same way."""
        return self.kind not in NOT_RETRYABLE

    def to_dict(self) -> dict:
        """JSON-able form, for outcomes and the ledger."""
        return {"kind": self.kind.value, "retryable": self.retryable, "reason": self.reason,
                "injected": self.injected}


@dataclass(frozen=True)
class MemoryEvents:
    """The cgroup v2 `memory.events` counters that tell an OOM kill."""

    oom: int
    oom_kill: int


def _cgroup_dir(pid: int | str = "self", root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """The cgroup v2 directory of a process (`0::/path` in /proc/<pid>/cgroup)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return None


def read_memory_events(cgroup: str | Path | None = None) -> MemoryEvents | None:
    """The `oom` and `oom_kill` counters of a cgroup v2 directory (default: this process's
    cgroup), or None when there is no cgroup v2 memory controller to read."""
    directory = Path(cgroup) if cgroup is not None else _cgroup_dir()
    if directory is None:
        return None
    try:
        text = (directory / "memory.events").read_text()
    except OSError:
        return None
    counters = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
    try:
        return MemoryEvents(oom=int(counters.get("oom", 0)), oom_kill=int(counters.get("oom_kill", 0)))
    except ValueError:
        return None


def read_peak_rss(pid: int) -> int | None:
    """Peak resident set size (`VmHWM`) of a live process in bytes, or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _oom_killed(before: MemoryEvents | None, after: MemoryEvents | None) -> bool:
    return before is not None and after is not None and after.oom_kill > before.oom_kill


def classify_failure(
    exit_code: int | None,
    output: str = "",
    *,
    timed_out: bool = False,
    injected: dict | None = None,
    preempted: dict | None = None,
    events_before: MemoryEvents | None = None,
    events_after: MemoryEvents | None = None,
    peak_rss_bytes: int | None = None,
    memory_limit_bytes: int | None = None,
) -> Failure:
    """Classify one failed worker attempt (see the module docstring for the order).

    `exit_code`: the process status (negative for a signal, as `subprocess` reports it; 128 +
    signal as a shell or container runtime does), None if it never exited. `output`: its
    last output lines. `injected`: the attempt's fault marker, if any; `preempted`: its
    preempted marker (`engine.preemption`), if any."""
    if exit_code == 0 and not timed_out:
        raise ZooidValueError("exit_code", "0 is a success, not a failure to classify")
    tail = output[-4000:] if output else ""
    reported = PREFECT_EXIT_TEXT.findall(tail) if exit_code is None else []
    exit_code = int(reported[-1]) if reported else exit_code
    if injected:
        what = f"injected {injected.get('kind', 'fault')} at step {injected.get('step')}"
        kind = {"oom_worker": FailureKind.OOM, "preempt_worker": FailureKind.PREEMPTED}.get(
            injected.get("kind"), FailureKind.INJECTED)
        return Failure(kind, what, injected=True)
    if preempted:
        how = "handed over" if preempted.get("handover") else "left"
        return Failure(FailureKind.PREEMPTED, f"the notice came; {how} at step {preempted.get('step')}")
    if timed_out:
        return Failure(FailureKind.TIMEOUT, "the worker timeout fired")
    if exit_code == EXIT_PREEMPTED or PREEMPTED_TEXT.search(tail):
        return Failure(FailureKind.PREEMPTED, f"exit {exit_code}: the notice came, no marker")
    if exit_code in SIGTERM_CODES or (exit_code is None and SIGTERM_TEXT.search(tail)):
        return Failure(FailureKind.PREEMPTED, f"exit {exit_code}: SIGTERM, nothing handed over")
    if exit_code == EXIT_BAD_INPUT or BAD_INPUT_TEXT.search(tail):
        return Failure(FailureKind.BAD_INPUT, f"exit {exit_code}: bad input")
    unreadable = DATA_TEXT.findall(tail)
    if exit_code == EXIT_DATA or unreadable:
        return Failure(FailureKind.DATA, f"exit {exit_code}: "
                                         f"{unreadable[-1].strip() if unreadable else 'the data is unreadable'}")
    if exit_code == EXIT_OOM or OOM_TEXT.search(tail):
        return Failure(FailureKind.OOM, f"exit {exit_code}: out-of-memory error in the output")
    if exit_code in SIGKILL_CODES:
        if _oom_killed(events_before, events_after):
            return Failure(FailureKind.OOM, "SIGKILL with a cgroup oom_kill increase")
        if peak_rss_bytes and memory_limit_bytes and peak_rss_bytes >= NEAR_LIMIT * memory_limit_bytes:
            return Failure(FailureKind.OOM, f"SIGKILL at peak RSS {peak_rss_bytes} of limit {memory_limit_bytes}")
    if exit_code == EXIT_STORE_TIMEOUT or STORE_TIMEOUT_TEXT.search(tail):
        return Failure(FailureKind.STORE_TIMEOUT, f"exit {exit_code}: a store wait timed out")
    return Failure(FailureKind.CRASH, f"exit {exit_code}")

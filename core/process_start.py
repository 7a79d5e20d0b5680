"""When this process started, for a worker's start-up measured from the very beginning of its
process (`runtime.warm`): the kernel's start time, or a fork server's mark where that is too
coarse."""
from __future__ import annotations

import os
import time

STARTED_AT_VAR = "ZOOID_STARTED_AT"
"""`<pid>:<unix time>`, set by a fork server in each process it forks (`runtime.fork_server`,
`flows.flow_forks`; `mark_forked`): when that process began. The kernel's start time is only as
fine as a clock tick (10 ms), about as long as a forked worker takes to be ready. The pid keeps
the mark from counting for a process the forked one starts in turn."""


def mark_forked(forked_at: float) -> None:
    """In a process just forked (its environment already its own): it began at `forked_at`."""
    os.environ[STARTED_AT_VAR] = f"{os.getpid()}:{forked_at!r}"


FLOW_FORKS_VAR = "ZOOID_FLOW_FORKS"
"""The variable naming the socket of the local stack's flow-run fork server (`flows.flow_forks`):
here, below both the stack that sets it and the client that reads it, because every flow run
the stack starts imports that client afresh."""


_IMPORTED_AT = time.time()
"""When this module was imported: the start of the process's clock where /proc cannot tell."""


def process_started_at() -> tuple[float, str]:
    """When this process started (wall clock), and from what: the fork server's mark
    (`STARTED_AT_VAR`), else the kernel's start time of the process (/proc/self/stat, so the
    interpreter's start-up and every import count), or, where /proc is missing, the import of
    this module."""
    pid, _, at = os.environ.get(STARTED_AT_VAR, "").partition(":")
    if pid == str(os.getpid()):
        return float(at), "process start"
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")), "process start"
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT, "core.process_start import"

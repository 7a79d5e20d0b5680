"""Find and stop a run's worker processes by tag, even when their coordinator died.

Every worker process Zooid starts (inline, or through the process work pool) carries
`ZOOID_RUN_ID=<run_id>` in its environment; the sweep reads `/proc/<pid>/environ` and stops
each matching process group by pid. Never by name.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

TAG_VAR = "ZOOID_RUN_ID"


def tagged_pids(run_id: str) -> list[int]:
    """Pids of live processes whose environment carries `ZOOID_RUN_ID=<run_id>`."""
    needle = f"{TAG_VAR}={run_id}".encode()
    pids = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in env.split(b"\0"):
            pids.append(int(entry.name))
    return sorted(pids)


def stop_pids(pids: list[int], grace_s: float = 3.0) -> list[int]:
    """SIGTERM each pid's process group (or the pid), wait, then SIGKILL what is left."""
    def _signal(pid: int, sig: int) -> None:
        try:
            pgid = os.getpgid(pid)
            if pgid == pid:
                os.killpg(pgid, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def sweep_run(run_id: str) -> list[int]:
    """Stop every process tagged with `run_id`; return the pids stopped."""
    return stop_pids(tagged_pids(run_id))

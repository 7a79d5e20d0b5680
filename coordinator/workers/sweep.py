"""Find and stop a run's worker processes by tag, even when their coordinator died.

Every worker process Zooid starts (inline, or through the process work pool) carries
`ZOOID_RUN_ID=<run_id>` in its environment, and so does an inline run's fork server; the
sweep reads `/proc/<pid>/environ` and stops each matching process group by pid. Never by
name. The orphan sweep stops only the orphans of this Zooid home (`ZOOID_HOME`, unset counting as one home of its own): another home's runs,
another stack or another user's, are theirs to sweep.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from runtime.fork_server import FORK_SERVER_NAME

TAG_VAR = "ZOOID_RUN_ID"
COORDINATOR_VAR = "ZOOID_COORDINATOR_PID"
HOME_VAR = "ZOOID_HOME"


def _tagged_processes() -> dict[int, dict[str, str]]:
    """Live processes carrying a Zooid run tag: pid -> their Zooid variables (and `comm`, the
    process's name)."""
    found = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
            head, tail = (entry / "stat").read_text().rsplit(")", 1)
            comm, state = head.split("(", 1)[1], tail.split()[0]
        except (OSError, IndexError, ValueError):
            continue
        if state == "Z" or f"{TAG_VAR}=".encode() not in env:
            continue
        pairs = dict(item.split(b"=", 1) for item in env.split(b"\0") if b"=" in item)
        found[int(entry.name)] = {k.decode(): pairs[k].decode(errors="replace")
                                  for k in (TAG_VAR.encode(), COORDINATOR_VAR.encode(), HOME_VAR.encode()) if k in pairs}
        found[int(entry.name)]["comm"] = comm
    return found


def _run_processes(run_id: str) -> dict[int, dict[str, str]]:
    return {pid: tags for pid, tags in _tagged_processes().items() if tags.get(TAG_VAR) == run_id}


def tagged_pids(run_id: str) -> list[int]:
    """Pids of live processes whose environment carries `ZOOID_RUN_ID=<run_id>`."""
    return sorted(_run_processes(run_id))


def worker_pids(run_id: str) -> list[int]:
    """`tagged_pids(run_id)` less the run's fork server (`runtime.fork_server`): its workers."""
    return workers_by_run().get(run_id, [])


def workers_by_run() -> dict[str, list[int]]:
    """Every run's worker pids (`worker_pids`), from one reading of `/proc`: a count over
    several runs at one moment."""
    found: dict[str, list[int]] = {}
    for pid, tags in sorted(_tagged_processes().items()):
        if tags["comm"] != FORK_SERVER_NAME:
            found.setdefault(tags.get(TAG_VAR, ""), []).append(pid)
    return found


def orphan_pids(home: str | None = None) -> list[int]:
    """Tagged worker processes of Zooid home `home` (default: this process's `ZOOID_HOME`, ""
    when unset) whose coordinator process is gone."""
    home = os.environ.get(HOME_VAR, "") if home is None else home
    orphans = []
    for pid, tags in _tagged_processes().items():
        coordinator = tags.get(COORDINATOR_VAR, "")
        if tags.get(HOME_VAR, "") == home and coordinator.isdigit() and not alive(int(coordinator)):
            orphans.append(pid)
    return sorted(orphans)


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
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    return pids


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def sweep_run(run_id: str) -> list[int]:
    """Stop every process tagged with `run_id`; return the pids stopped."""
    return stop_pids(tagged_pids(run_id))


def sweep_orphans() -> list[int]:
    """Stop every worker of this Zooid home whose coordinator died (run at the start of each
    run and by hand)."""
    return stop_pids(orphan_pids())


def main(argv: list[str] | None = None) -> int:
    """`python -m coordinator.workers.sweep RUN_ID` stops a run's workers; `--orphans` those whose coordinator died."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m coordinator.workers.sweep", description=main.__doc__)
    parser.add_argument("run_id", nargs="?")
    parser.add_argument("--orphans", action="store_true")
    args = parser.parse_args(argv)
    if not args.run_id and not args.orphans:
        parser.error("give a run id or --orphans")
    stopped = sweep_orphans() if args.orphans else sweep_run(args.run_id)
    print(f"stopped {len(stopped)} process(es): {stopped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

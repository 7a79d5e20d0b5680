"""`python -m deployments.orphan_guard PARENT_PID -- COMMAND ...`: run COMMAND while PARENT_PID lives.

A command-line run's temporary Prefect server lives in a session of its own, so that the
Ctrl-C or SIGTERM stopping the run does not take the API its teardown still needs. Were the
run killed outright (SIGKILL, a lost machine), nothing would stop that server: this guard is
its parent and stops it (SIGTERM, then SIGKILL after 10 s) once the run that asked for it is
gone, or exits with the command's status when the command ends first.

The guard is stopped as its callers start it: leader of a session of its own, signalled as a
group (`killpg`). That signal has reached the command too, so the guard does not send it a
second: a second SIGTERM ends many servers at once, mid-shutdown (Node's Azurite drops the
database it was writing, uvicorn skips its graceful close). It waits out the grace instead.
Only a guard signalled outside its own group (a caller that made it no leader) passes the
signal on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _stop(child: subprocess.Popen, grace_s: float = 10.0, signal_it: bool = True) -> int:
    if signal_it:
        child.terminate()
    try:
        return child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m deployments.orphan_guard PARENT_PID -- COMMAND ...", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[2:]
    child = subprocess.Popen(command)
    group_signalled = os.getpgid(0) == os.getpid()  # the leader: a stop reaches the command too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(_stop(child, signal_it=not group_signalled)))
    while child.poll() is None:
        if os.getppid() != parent:  # the run is gone: this guard was handed to another parent
            return _stop(child)
        time.sleep(0.5)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())

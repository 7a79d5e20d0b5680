"""`python -m deployments.orphan_guard PARENT_PID -- COMMAND ...`: run COMMAND while PARENT_PID lives.

A command-line run's temporary Prefect server lives in a session of its own, so that the
Ctrl-C or SIGTERM stopping the run does not take the API its teardown still needs. Were the
run killed outright (SIGKILL, a lost machine), nothing would stop that server: this guard is
its parent and stops it (SIGTERM, then SIGKILL after 10 s) once the run that asked for it is
gone, or exits with the command's status when the command ends first.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _stop(child: subprocess.Popen, grace_s: float = 10.0) -> int:
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
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(_stop(child)))
    while child.poll() is None:
        if os.getppid() != parent:  # the run is gone: this guard was handed to another parent
            return _stop(child)
        time.sleep(0.5)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())

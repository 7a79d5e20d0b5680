"""The tests' own servers (Azurite, the recording moto) run under the orphan guard
(`tests.conftest.guarded`): a test process killed outright leaves none of them running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PARENT = """
import subprocess, sys
sys.path.insert(0, {root!r})
from tests.conftest import guarded
guard = subprocess.Popen(guarded(["sleep", "300"]), start_new_session=True)
print(guard.pid, flush=True)
sys.stdin.read()
"""


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether `pid` has exited (or is a zombie) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_server_outlives_no_test_process_killed_outright():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(root=str(ROOT))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    guard = int(parent.stdout.readline())
    server = None
    deadline = time.monotonic() + 30
    while server is None and time.monotonic() < deadline:  # the guard starts its command
        kids = _children(guard)
        server = kids[0] if kids else None
        time.sleep(0.05)
    assert server is not None
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert _gone(server), "the guarded command outlived the test process"

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


_ONCE = """
import os, signal, sys, time
from pathlib import Path
here = Path(sys.argv[1])

def shut_down(signum, frame):  # as Node's `process.once("SIGTERM")`: a second signal kills
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    (here / "closing").write_text("")
    while not (here / "go").exists():
        time.sleep(0.02)
    (here / "closed").write_text("")
    sys.exit(0)

signal.signal(signal.SIGTERM, shut_down)
(here / "up").write_text("")
while True:
    time.sleep(1)
"""


def test_a_guard_stopped_as_a_group_lets_its_command_shut_down_on_the_one_signal(tmp_path):
    """Every caller stops the guard as it started it, a group leader signalled by `killpg`:
    the command has the signal already and is not sent a second, which would end a server
    such as Azurite mid-shutdown, its database unwritten."""
    from tests.conftest import guarded, stop_process_group

    guard = subprocess.Popen(guarded([sys.executable, "-c", _ONCE, str(tmp_path)]), start_new_session=True)
    try:
        while not (tmp_path / "up").exists():
            assert guard.poll() is None
            time.sleep(0.02)
        os.killpg(guard.pid, signal.SIGTERM)
        while not (tmp_path / "closing").exists():
            assert guard.poll() is None, "the command died before its shutdown began"
            time.sleep(0.02)
        (tmp_path / "go").write_text("")
        assert guard.wait(timeout=60) == 0  # the command's own status: it was not killed
        assert (tmp_path / "closed").exists()
    finally:
        stop_process_group(guard)

"""The stack's flow-run fork server (`flows.flow_forks`): a client becomes its forked child
(output, environment, working directory, exit status), passes signals on, takes its child
down when killed, and runs the module itself when there is no server or the sources changed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.server import FLOW_FORKS_VAR
from tests.conftest import stop_process_group

ROOT = Path(__file__).resolve().parents[1]
PROBE = "tests.flow_fork_probe"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One fork server on a socket of its own (its imports take seconds: shared by the module)."""
    tmp = tmp_path_factory.mktemp("forks")
    sock = str(tmp / "f.sock")
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "flows.flow_forks", "serve", sock], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "listening on" not in (tmp / "server.log").read_text():
            assert proc.poll() is None, (tmp / "server.log").read_text()
            assert time.monotonic() < deadline, "the fork server did not start listening"
            time.sleep(0.1)
        yield {"socket": sock, "proc": proc, "log": tmp / "server.log"}
    finally:
        stop_process_group(proc)
        log.close()


def client(sock: str | None, *args: str, cwd: Path, **extra_env) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra_env}  # the probe is in tests/, not installed
    env.pop(FLOW_FORKS_VAR, None)
    if sock:
        env[FLOW_FORKS_VAR] = sock
    return subprocess.Popen([sys.executable, "-m", "flows.flow_forks", "-m", PROBE, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def report(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def test_the_client_becomes_its_forked_child(server, tmp_path):
    proc = client(server["socket"], "exit", "7", cwd=tmp_path, ZOOID_PROBE_VALUE="hello")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    seen = report(out)
    # the child is the server's, not the client's, and it took the client's environment and directory
    assert seen["ppid"] == server["proc"].pid and seen["pid"] != proc.pid
    assert seen["value"] == "hello" and seen["cwd"] == str(tmp_path)
    assert seen["argv"][0].endswith("flow_fork_probe.py") and seen["argv"][1:] == ["exit", "7"]  # as `python -m`
    assert seen["preloaded"]  # torch and the flows came with the fork
    assert "to stderr" in err


def test_a_signal_reaches_the_child_and_its_status_comes_back(server, tmp_path):
    proc = client(server["socket"], "wait", cwd=tmp_path)
    ready = proc.stdout.readline()  # the child says it is waiting for a signal
    assert report(ready)["waiting"]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert "got signal 15" in out
    assert proc.returncode == 143, err  # the probe exits 128 + 15, as it was told


def test_a_killed_client_takes_its_child_down(server, tmp_path):
    proc = client(server["socket"], "wait", cwd=tmp_path)
    child = report(proc.stdout.readline())["pid"]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(child):
        assert time.monotonic() < deadline, "the forked child outlived its killed client"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_without_a_server_the_client_runs_the_module_itself(tmp_path):
    for sock in (None, str(tmp_path / "nobody.sock")):
        proc = client(sock, "exit", "3", cwd=tmp_path)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 3, err
        assert report(out)["pid"] == proc.pid  # exec'd in place: the same process


def test_changed_sources_make_the_server_refuse_and_start_afresh(server, tmp_path):
    probe = ROOT / "flows" / "flow_forks.py"
    mtime = probe.stat().st_mtime
    os.utime(probe, (mtime, mtime + 1))  # the source looks edited (its bytes are the same)
    proc = client(server["socket"], "exit", "0", cwd=tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert report(out)["pid"] == proc.pid  # refused as stale: the client ran it itself
    deadline = time.monotonic() + 120
    while server["log"].read_text().count("listening on") < 2:  # the server replaced itself
        assert time.monotonic() < deadline, server["log"].read_text()
        time.sleep(0.1)
    assert "sources changed" in server["log"].read_text()
    proc = client(server["socket"], "exit", "0", cwd=tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and report(out)["ppid"] == server["proc"].pid, err


def test_the_client_imports_nothing_of_the_server_side():
    """Every flow run the stack starts runs the client as a fresh interpreter: it imports the
    standard library's few modules and `core.process_start`, not Prefect, torch or the project's
    other packages (`deployments.server` alone took 44 ms of each start)."""
    code = ("import sys, flows.flow_forks; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    top = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split())
    project = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert top & project == {"core", "flows"}
    assert not top & {"prefect", "torch", "numpy", "sqlite3", "http"}

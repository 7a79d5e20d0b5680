"""The services test processes share (`tests.shared_services`) start once, remember a failed
start, and are stopped by the command their state names; `deployments.server.file_lock` is the
lock that makes the first start the only one."""
from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.server import file_lock
from tests.shared_services import release_shared_service, shared_service, stop_shared_services


def _config(folder):
    """A main process's pytest config, as far as the shared services read it."""
    return SimpleNamespace(_tmp_path_factory=SimpleNamespace(getbasetemp=lambda: folder))


def test_file_lock_excludes_another_holder_until_released(tmp_path):
    path = tmp_path / "x.lock"
    with file_lock(path):
        with open(path, "a") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again


def test_a_shared_service_starts_once_and_is_stopped_by_its_command(tmp_path):
    config, starts = _config(tmp_path), []
    stopped = tmp_path / "stopped"

    def start(home):
        starts.append(home)
        return {"url": "http://127.0.0.1:1", "stop": {"argv": [sys.executable, "-c", f"open({str(stopped)!r}, 'w')"],
                                                      "env": {}}}

    first, again = shared_service(config, "svc", start), shared_service(config, "svc", start)
    assert first == again and first["url"] == "http://127.0.0.1:1"
    assert starts == [tmp_path / "shared-svc"] and starts[0].is_dir()
    assert json.loads((tmp_path / "shared-svc.json").read_text()) == first
    stop_shared_services(config)
    assert stopped.exists() and not (tmp_path / "shared-svc.json").exists()


def test_a_failed_start_is_not_tried_again(tmp_path):
    config, starts = _config(tmp_path), []

    def start(home):
        starts.append(home)
        raise RuntimeError("port taken")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="port taken"):
            shared_service(config, "svc", start)
    assert len(starts) == 1
    stop_shared_services(config)  # nothing started, nothing to stop


def test_a_shared_service_stops_once_its_last_user_is_done(tmp_path):
    config, stopped = _config(tmp_path), tmp_path / "stopped"

    def start(home):
        return {"stop": {"argv": [sys.executable, "-c", f"open({str(stopped)!r}, 'w')"], "env": {}}}

    users = {"tests/test_a.py", "tests/test_b.py"}
    shared_service(config, "svc", start)
    assert not release_shared_service(config, "svc", "tests/test_a.py", users)
    assert not stopped.exists()
    assert release_shared_service(config, "svc", "tests/test_b.py", users)  # the last user: stopped now
    assert stopped.exists() and not (tmp_path / "shared-svc.json").exists()
    with pytest.raises(RuntimeError, match="was stopped once its last user, tests/test_b.py, was done"):
        shared_service(config, "svc", start)  # not started again behind the session's back
    stopped.unlink()
    stop_shared_services(config)  # nothing left to stop at the session's end
    assert not stopped.exists()


COLLECT_USERS = """
import json, sys
import pytest
from tests.docker_stack import uses_the_shared_stack

class Users:
    def pytest_collection_finish(self, session):
        print("USERS " + json.dumps(sorted({i.nodeid.split("::")[0] for i in session.items if uses_the_shared_stack(i)})))

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Users()]))
"""


def test_the_docker_stack_s_users_are_the_files_whose_stack_fixture_is_the_session_s():
    """`test_refused_runs.py` has a `stack` fixture of its own (a local stack): counted among the
    session stack's users, it never released the stack, which then idled to the session's end."""
    root = Path(__file__).resolve().parent.parent
    files = ["tests/test_refused_runs.py", "tests/test_local_stack_cancel.py", "tests/test_docker_listing.py",
             "tests/test_docker_target.py"]
    out = subprocess.run([sys.executable, "-c", COLLECT_USERS, *files], cwd=root, capture_output=True, text=True,
                         timeout=300).stdout
    users = json.loads(next(line for line in out.splitlines() if line.startswith("USERS "))[6:])
    assert users == ["tests/test_docker_target.py", "tests/test_local_stack_cancel.py"], out[-2000:]

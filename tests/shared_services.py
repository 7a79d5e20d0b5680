"""Services the test processes of one session share.

`make test` runs the suite in several processes; a service that many tests need (the local stack
with its container half, the Prefect API) is started once for the whole session by the first
process that asks for it, under a lock, and every process reads its state from the session's
shared folder. It is stopped by the command its state names: once the last test module that
uses it is done (`release_shared_service`, where its users say so), else by the main process when
the session ends (the root conftest's `pytest_sessionfinish`). A service that failed to start is not
tried again: every process that asks gets the first failure.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

from deployments.server import file_lock


def shared_folder(config) -> Path:
    """The folder every process of this test session sees: the main process's base temp (a
    pytest-xdist worker's own base temp is a folder below it)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


def shared_service(config, name: str, start: Callable[[Path], dict]) -> dict:
    """The state of service `name`, started once for the session: `start(folder)` runs in the
    first process that asks, with a folder of the service's own, and returns a JSON-able state
    with `stop`: {"argv": [...], "env": {...}}, the command that stops the service."""
    folder = shared_folder(config)
    state_file, failed = folder / f"shared-{name}.json", folder / f"shared-{name}.failed"
    with file_lock(folder / f"shared-{name}.lock"):
        if failed.exists():
            raise RuntimeError(f"the shared {name} did not start (in another test process): {failed.read_text()}")
        if not state_file.exists():
            home = folder / f"shared-{name}"
            home.mkdir(exist_ok=True)
            try:
                state = start(home)
            except BaseException as exc:
                failed.write_text(str(exc)[-4000:])
                raise
            state_file.write_text(json.dumps(state))
        return json.loads(state_file.read_text())


def release_shared_service(config, name: str, user: str, users: set[str]) -> bool:
    """`user` (a test module) is done with service `name`; once every one of `users` (the
    modules of this session's collection that use it) is, the service is stopped now rather
    than at the session's end, where it would idle, polling, while other tests run. True when
    this call stopped it. A module that asks for it afterwards gets the failure of a service
    that is gone (`shared_service`)."""
    folder = shared_folder(config)
    done_file, state_file = folder / f"shared-{name}.done", folder / f"shared-{name}.json"
    with file_lock(folder / f"shared-{name}.lock"):
        done = set(json.loads(done_file.read_text())) if done_file.exists() else set()
        done.add(user)
        done_file.write_text(json.dumps(sorted(done)))
        if not users <= done or not state_file.exists():
            return False
        _stop(state_file)
        (folder / f"shared-{name}.failed").write_text(f"the shared {name} was stopped once its last user, {user}, "
                                                      "was done")
        return True


def _stop(state_file: Path) -> None:
    stop = json.loads(state_file.read_text())["stop"]
    subprocess.run(stop["argv"], env=stop["env"], cwd=stop.get("cwd"), capture_output=True, timeout=180)
    state_file.unlink()


def stop_shared_services(config) -> None:
    """Stop every shared service of the session (the main process, once all test processes are done)."""
    for state_file in sorted(shared_folder(config).glob("shared-*.json")):
        _stop(state_file)

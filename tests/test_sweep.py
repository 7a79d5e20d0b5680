"""The sweep finds a run's worker processes by their tag, and orphans whose coordinator died."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coordinator.workers.sweep import (
    COORDINATOR_VAR,
    HOME_VAR,
    TAG_VAR,
    orphan_pids,
    sweep_orphans,
    sweep_run,
    tagged_pids,
    worker_pids,
    workers_by_run,
)


def _spawn(env_extra: dict, name: str = "") -> subprocess.Popen:
    """A tagged process that idles (named `name` in /proc/<pid>/comm where given, as
    `runtime.fork_server` names itself); returns once it runs Python with its environment
    and name (it says so on stdout: an event, not a sleep)."""
    rename = f"from runtime.fork_server import _set_name; _set_name({name!r}); " if name else ""
    proc = subprocess.Popen([sys.executable, "-c", rename + "import time; print('up', flush=True); time.sleep(60)"],
                            env={**os.environ, **env_extra}, start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    return proc


@pytest.mark.timeout(60)
def test_sweep_by_run_id_stops_only_that_run():
    mine = [_spawn({TAG_VAR: "zsweep-a"}) for _ in range(2)]
    other = _spawn({TAG_VAR: "zsweep-b"})
    try:
        assert tagged_pids("zsweep-a") == sorted(p.pid for p in mine)
        stopped = sweep_run("zsweep-a")
        assert sorted(stopped) == sorted(p.pid for p in mine)
        for p in mine:
            assert p.wait(timeout=10) is not None
        assert tagged_pids("zsweep-a") == []
        assert tagged_pids("zsweep-b") == [other.pid]
    finally:
        other.kill()
        other.wait()


@pytest.mark.timeout(60)
def test_workers_are_counted_by_run_without_the_runs_fork_server():
    from runtime.fork_server import FORK_SERVER_NAME

    mine = [_spawn({TAG_VAR: "zsweep-w"}) for _ in range(2)]
    server = _spawn({TAG_VAR: "zsweep-w"}, name=FORK_SERVER_NAME)
    other = _spawn({TAG_VAR: "zsweep-x"})
    try:
        by_run = workers_by_run()
        assert by_run["zsweep-w"] == worker_pids("zsweep-w") == sorted(p.pid for p in mine)
        assert by_run["zsweep-x"] == [other.pid]
        assert server.pid in tagged_pids("zsweep-w")  # a tagged process, but no worker
    finally:
        for p in (*mine, server, other):
            p.kill()
            p.wait()


@pytest.mark.timeout(60)
def test_orphans_of_a_dead_coordinator_are_swept():
    coordinator = subprocess.Popen([sys.executable, "-c", "pass"])
    coordinator.wait()  # a coordinator that died
    orphan = _spawn({TAG_VAR: "zsweep-c", COORDINATOR_VAR: str(coordinator.pid)})
    alive_parent = _spawn({TAG_VAR: "zsweep-d", COORDINATOR_VAR: str(os.getpid())})
    try:
        assert orphan.pid in orphan_pids() and alive_parent.pid not in orphan_pids()
        sweep_orphans()
        assert orphan.wait(timeout=10) is not None
        assert alive_parent.poll() is None
    finally:
        alive_parent.kill()
        alive_parent.wait()


@pytest.mark.timeout(60)
def test_the_orphan_sweep_leaves_another_homes_orphans_alone():
    """Two Zooid homes on one machine (two stacks, two users, two test processes): a run's
    orphan sweep stops its own home's orphans only."""
    coordinator = subprocess.Popen([sys.executable, "-c", "pass"])
    coordinator.wait()
    here = os.environ.get(HOME_VAR, "")
    ours = _spawn({TAG_VAR: "zsweep-e", COORDINATOR_VAR: str(coordinator.pid), HOME_VAR: here})
    theirs = _spawn({TAG_VAR: "zsweep-f", COORDINATOR_VAR: str(coordinator.pid), HOME_VAR: here + "-elsewhere"})
    try:
        assert ours.pid in orphan_pids() and theirs.pid not in orphan_pids()
        assert theirs.pid in orphan_pids(home=here + "-elsewhere")
        sweep_orphans()
        assert ours.wait(timeout=10) is not None
        assert theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait()

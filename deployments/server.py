"""A Prefect server process on 127.0.0.1, the pieces the local stack and the command line share.

`temporary_server` is the command line's own API for one run (`python -m flows.train`
without `PREFECT_API_URL`); `deployments.stack` builds the long-lived local stack from the
same pieces. Every process starts in a session of its own and is stopped by pid.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from core.process_start import FLOW_FORKS_VAR
from deployments.prefect_db import DB, DB_URL_VARIABLES, MEMO, seed_home, template_dir

ROOT = Path(__file__).resolve().parent.parent


def server_command(port: int) -> list[str]:
    """The Prefect server of every Zooid server process on 127.0.0.1:`port`: Prefect's app, with
    SQLite's lock conflicts retried in the server (`deployments.prefect_api`)."""
    return [sys.executable, "-m", "deployments.prefect_api", "--host", "127.0.0.1", "--port", str(port)]


def zooid_home() -> Path:
    return Path(os.environ.get("ZOOID_HOME", ROOT / ".zooid")).resolve()


def free_port(preferred: int = 4200) -> int:
    """`preferred` when it is free on 127.0.0.1, else any free port."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return s.getsockname()[1]
            except OSError:
                continue
    raise RuntimeError("no free port")


def stack_env(home: Path, api_url: str) -> dict[str, str]:
    """The variables every process of the stack (and a user's shell) needs."""
    return {
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        # the pool's poll: a run waits half of it on average, twice (its flow run, then its workers');
        # measured on an idle stack, 0.5 s costs 4.1-4.8 % of a core against 1 s's 2.1-2.7 %
        "PREFECT_WORKER_QUERY_SECONDS": "0.5",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        # the server streams each flow run's logs out, so `prefect deployment run --watch` shows them
        # (a refused run's one line among them: flows.params.log_refusal), not its state changes alone
        "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
        "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
        "ZOOID_HOME": str(home),
        "ZOOID_ROOT": str(ROOT),
        FLOW_FORKS_VAR: flow_forks_socket(home),
    }


def flow_forks_socket(home: Path) -> str:
    """Where the stack's flow-run fork server listens: in its home, or under the temporary
    directory, named by the home's hash, where that path would be too long for a Unix socket
    (107 bytes)."""
    path = home / "flow-forks.sock"
    if len(str(path)) <= 100:
        return str(path)
    return str(Path(tempfile.gettempdir()) / f"zooid-forks-{hashlib.sha1(str(home).encode()).hexdigest()[:12]}.sock")


def bin_path(name: str) -> str:
    """A console script of this interpreter's environment (`prefect`)."""
    return str(Path(sys.executable).with_name(name))


def spawn(args: list[str], env: dict, log: Path) -> int:
    """Start `args` in a session of its own, output to `log`; its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
    return proc.pid


def wait_healthy(api_url: str, timeout_s: float = 120.0) -> None:
    """Wait for the Prefect API at `api_url` to answer its health check."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"Prefect server at {api_url} did not become healthy in {timeout_s:.0f} s")


def alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def stop_groups(pids: list[int], poll_s: float = 0.02) -> None:
    """SIGTERM the process groups these pids lead, then SIGKILL what is left after 10 s;
    whether they are gone is checked every `poll_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(poll_s)
            for pid in pids:  # reap our own children if we started them
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        if not any(alive(p) for p in pids):
            break


@contextlib.contextmanager
def file_lock(path: Path):
    """Hold an exclusive lock on the file at `path` (created if missing) for the block: one
    process at a time, across processes."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def drain_prefect_clients(timeout_s: float = 5.0) -> None:
    """Send this process's pending Prefect logs and events to the API it talks to now, before
    that server stops. Left for the process's exit, they are flushed towards a server that is
    gone, and the events client retries for minutes."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=timeout_s, at_exit=False)


class TemporaryServer:
    """A Prefect server (SQLite under `$ZOOID_HOME/prefect`) for one command-line run, started
    at construction (so its start-up overlaps the caller's own work: imports, validation) and
    stopped by pid with `stop` (idempotent). It runs in a session of its own, so the Ctrl-C or
    SIGTERM that stops the run does not stop the API that the run's teardown and bill still
    need (Prefect's temporary server is a child in the run's process group, and dies with it);
    its guard (`deployments.orphan_guard`) stops it if the run is killed outright."""

    def __init__(self, home: Path | None = None):
        home = home or zooid_home()
        port = free_port(0)
        self.url = f"http://127.0.0.1:{port}/api"
        env = {**stack_env(home, ""), "PREFECT_API_URL": ""}
        seed_home(Path(env["PREFECT_HOME"]), {**os.environ, **env})
        self.pid: int | None = spawn([sys.executable, "-m", "deployments.orphan_guard", str(os.getpid()), "--",
                                      *server_command(port)], env, home / "logs" / f"server-{port}.log")

    def wait(self) -> str:
        """Block until the API answers; its URL."""
        wait_healthy(self.url)
        return self.url

    def stop(self) -> None:
        if self.pid is not None:
            stop_groups([self.pid])
            self.pid = None


@contextlib.contextmanager
def temporary_server(home: Path | None = None, started: TemporaryServer | None = None):
    """A `TemporaryServer` (`started`, or one started now) for the block: yields its API URL
    once it answers, stops it after."""
    server = started or TemporaryServer(home)
    try:
        yield server.wait()
    finally:
        server.stop()


def build_db_template() -> Path:
    """Start a server on an empty home, stop it, and keep its database and memo as the
    template new homes start from (`deployments.prefect_db`), replacing an older one; the
    template's folder."""
    target = template_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="prefect-db-", dir=target.parent) as scratch:
        home = Path(scratch) / "home"
        port = free_port(0)
        env = {"PREFECT_HOME": str(home), "PREFECT_API_URL": "", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "DO_NOT_TRACK": "1", **dict.fromkeys(DB_URL_VARIABLES, f"sqlite+aiosqlite:///{home / DB}")}
        # under the guard as the command line's server is: an install killed here leaves no server
        pid = spawn([sys.executable, "-m", "deployments.orphan_guard", str(os.getpid()), "--", *server_command(port)],
                    env, Path(scratch) / "server.log")
        try:
            wait_healthy(f"http://127.0.0.1:{port}/api")
        finally:
            stop_groups([pid])
        built = Path(scratch) / "template"
        built.mkdir()
        with contextlib.closing(sqlite3.connect(home / DB)) as source, \
                contextlib.closing(sqlite3.connect(built / DB)) as copy:
            source.backup(copy)  # one consistent file, whatever the server left in its journal
        if (home / MEMO).exists():
            shutil.copyfile(home / MEMO, built / MEMO)
        if target.exists():
            shutil.rmtree(target)
        os.replace(built, target)
    return target


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m deployments.server")
    parser.add_argument("command", choices=["db-template"], help="build the Prefect database template (make install)")
    parser.parse_args()
    print(f"Prefect database template: {build_db_template()}")

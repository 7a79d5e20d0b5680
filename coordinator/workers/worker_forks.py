"""Start a run's inline workers by forking them from a process that has imported torch already
(`runtime.fork_server`), instead of a fresh interpreter each: a worker is ready in
milliseconds rather than the 1.5 s of CPU its imports cost on this kind of machine.

`WorkerForks` is one run's fork server, started at the first worker the run starts, in the
run's environment (so its workers carry the run's tag for the sweep). It lives as long as the
run: the teardown ends it (`close`), and so does the coordinator's end (its stdin closes), and
the profile step's end where it started a one-off worker (a cold run, the dry run: the step
leaves nothing running). So a run imports torch once for its epochs, not again for each worker
set it starts after its last one left (each cold epoch, a relaunch into an empty run): 3.6 s of
CPU a fork server's imports on this machine (the median of the 104 that a run of the test suite
started when each ended with its last worker). `start()` returns a `ForkedWorker`, which answers `pid`, `poll()`,
`wait()` and `returncode` as `subprocess.Popen` does; when the fork server cannot start a
worker, `start()` returns None and the launcher starts the interpreter itself.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from coordinator.workers.sweep import alive


class ForkedWorker:
    """A worker forked by the fork server: `subprocess.Popen`'s `pid`, `poll()`, `wait()`,
    `returncode`. Its exit status comes from the fork server, its parent."""

    def __init__(self, forks: "WorkerForks", pid: int, server: subprocess.Popen):
        self.forks, self.pid, self.server = forks, pid, server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.forks.exit_code(self.pid, self.server)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            self.forks.changed.wait(0.05)
        return self.returncode


class WorkerForks:
    """One run's fork server (see the module's docstring)."""

    start_timeout_s = 300.0
    """How long a start waits for the fork server's answer (its first one waits for its imports)."""

    def __init__(self, env: dict[str, str], log: Path):
        self.env, self.log = dict(env), Path(log)
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.server: subprocess.Popen | None = None
        self.answers: queue.Queue = queue.Queue()
        self.exits: dict[int, int] = {}
        self.broken = False

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedWorker | None:
        """Fork a worker running `python -m runtime.worker_main *argv` in `env`, its output in
        `log`; None when the fork server cannot (the caller starts a process instead)."""
        request = (json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n").encode()
        with self.lock:
            for _ in range(2):  # a fork server that died is started afresh, once
                if self.broken:
                    return None
                server = self._server()
                try:
                    server.stdin.write(request)
                    server.stdin.flush()
                except (BrokenPipeError, OSError):
                    self._gone(server)
                    continue
                answer = self._answer(server)
                if answer is None:
                    self._gone(server)
                    continue
                if "pid" not in answer:
                    return None
                return ForkedWorker(self, answer["pid"], server)
            return None

    def exit_code(self, pid: int, server: subprocess.Popen) -> int | None:
        """`pid`'s exit status, None while it runs. Where its fork server died first, the
        worker is no child of anyone here: it has ended once its pid is gone."""
        if pid in self.exits:
            return self.exits[pid]
        if server.poll() is not None and not alive(pid):
            return self.exits.setdefault(pid, -9)
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """End the fork server (the run's teardown; its workers, stopped before, are not its to
        stop): its stdin closed, it exits; SIGKILL after `timeout_s`. Safe to call twice; a
        later `start` starts a fresh one."""
        with self.lock:
            server, self.server = self.server, None
        if server is None:
            return
        try:
            server.stdin.close()
        except OSError:
            pass
        try:
            server.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(server.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            server.wait()

    # --- the fork server's process -----------------------------------------------------------

    def _server(self) -> subprocess.Popen:
        if self.server is not None and self.server.poll() is None:
            return self.server
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as err:
            server = subprocess.Popen([sys.executable, "-m", "runtime.fork_server"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=err, env=self.env, start_new_session=True)
        self.server, self.answers = server, queue.Queue()
        threading.Thread(target=self._read, args=(server, self.answers), daemon=True,
                         name=f"fork-server-{server.pid}").start()
        return server

    def _read(self, server: subprocess.Popen, answers: queue.Queue) -> None:
        """The fork server's answers: exits recorded here, the rest queued for `start`."""
        for line in server.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "exit" in message:
                self.exits[message["exit"]] = message["code"]
                self.changed.set()
                self.changed.clear()
            else:
                answers.put(message)
        answers.put(None)  # its stdout closed: it ended
        self.changed.set()
        self.changed.clear()

    def _answer(self, server: subprocess.Popen) -> dict | None:
        try:
            return self.answers.get(timeout=self.start_timeout_s)
        except queue.Empty:
            self.broken = True  # hung: stop it and start processes from now on
            return None

    def _gone(self, server: subprocess.Popen) -> None:
        if self.broken:
            try:
                os.killpg(server.pid, 15)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            server.stdin.close()
        except OSError:
            pass
        server.wait()
        if self.server is server:
            self.server = None


"""`python -m runtime.fork_server`: start worker processes by forking one that has already
imported the worker's modules.

A worker started as `python -m runtime.worker_main` spends about 1.5 s of CPU importing torch
before it does anything; a run starts one per rank, a relaunch or a cold epoch another. The
coordinator of an `inline` run starts this process once (`coordinator.workers.worker_forks`): it
imports `runtime.worker_main` (torch, the stores, the engine) and then forks each worker from
itself, so a worker is ready in milliseconds.

The protocol is one JSON object a line. On stdin, a request to start a worker:
`{"argv": [...], "env": {...}, "log": "<path>"}` (the arguments of `runtime.worker_main`, the
worker's whole environment, the file its stdout and stderr go to). On stdout, each answer:
`{"pid": N}` (or `{"error": "..."}`), then, when a worker exits, `{"exit": N, "code": C}` with
C as `subprocess.Popen.returncode` reads it (negative: killed by that signal), and
nothing more: the server stays for the run's next worker.

The loop is `runtime.fork_loop`'s, shared with the local stack's flow-run fork server.
Each worker is a session of its own, like a `subprocess.Popen(start_new_session=True)`: stopped
by its pid's process group, never by this process's. This process runs in the run's
environment, so its workers carry the run's tag in `/proc/<pid>/environ` (`coordinator.workers.sweep`);
it names itself `FORK_SERVER_NAME` (`/proc/<pid>/comm`) so a count of the run's workers can
leave it out, and its workers take back the interpreter's name. It exits when its stdin closes:
the run's teardown (or its profile step, after a one-off worker) closed it, or the coordinator
ended or died (its workers go on until stopped or their lease ends). It does not leave with its
last worker: a run's epochs import once, however many workers their relaunches and cold epochs
start.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys

from core.process_start import mark_forked
from runtime.fork_loop import run_as_process, serve_forks

FORK_SERVER_NAME = "zooid-forks"
"""This process's name in `/proc/<pid>/comm` (at most 15 bytes)."""

_PR_SET_NAME = 15


def _set_name(name: str) -> None:
    """Set this process's `comm` (what `/proc/<pid>/stat` and `ps -o comm` show)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is cosmetic there
        pass


def _run_worker(argv: list[str], env: dict[str, str], log: str, forked_at: float,
                keep_fds: tuple[int, ...]) -> int:
    """In the forked child (a session of its own, under the interpreter's name): become a
    fresh worker process, run it, return its exit status."""
    import random

    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in {out, null, *keep_fds} - {0, 1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    mark_forked(forked_at)  # a clock tick of /proc is as long as this start
    sys.argv = ["-m runtime.worker_main", *argv]
    # a fresh process draws fresh seeds: so does a forked one (a worker seeds its training itself)
    random.seed()
    import torch

    torch.seed()
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from runtime.worker_main import main  # imported by the server already; not by whoever names FORK_SERVER_NAME

    return run_as_process(lambda: main(argv))


class _WorkerStarts:
    """The worker side's `ForkServer`: requests are JSON lines on the descriptor `requests`,
    answers JSON lines on `answers` (see the module docstring)."""

    def __init__(self, requests: int, answers: int, own_name: str):
        self.requests, self.answers, self.own_name = requests, answers, own_name
        self.buffer = b""

    def send(self, message: dict) -> None:
        os.write(self.answers, (json.dumps(message) + "\n").encode())

    def receive(self) -> list[dict] | None:
        """The whole lines read so far (a line that is no JSON answered as an error); None at EOF."""
        chunk = os.read(self.requests, 65536)
        if not chunk:
            return None
        self.buffer += chunk
        requests = []
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                requests.append(json.loads(line))
            except ValueError as exc:
                self.send({"error": f"{type(exc).__name__}: {exc}"})
        return requests

    def detach(self, request: dict, others) -> None:
        _set_name(self.own_name)  # a worker again, not the server, by the time the server answers

    def run_child(self, request: dict, forked_at: float) -> int:
        return _run_worker(request["argv"], request["env"], request["log"], forked_at,
                           (self.requests, self.answers))

    def started(self, request: dict, pid: int) -> None:
        self.send({"pid": pid})  # as `Popen(start_new_session=True)` returns: its session exists

    def failed(self, request: dict, exc: OSError) -> None:
        self.send({"error": f"{type(exc).__name__}: {exc}"})

    def exited(self, pid: int, to: None, code: int, last: bool) -> bool:
        """Tell of the exit; the server stays for the next request."""
        self.send({"exit": pid, "code": code})
        return False

    def finished(self, running: int) -> None:
        return None


def serve(requests: int, answers: int, own_name: str) -> int:
    """Answer start requests from the file descriptor `requests` on `answers` until it
    closes. The workers take `own_name`,
    the interpreter's name before `main` named this process, back as theirs."""
    return serve_forks(requests, _WorkerStarts(requests, answers, own_name))


def main() -> int:
    # named before the imports (a second of CPU): a count of the run's workers never takes
    # this process for one
    own_name = open("/proc/self/comm").read().strip() if os.path.exists("/proc/self/comm") else "python"
    _set_name(FORK_SERVER_NAME)
    # the worker's modules, imported once here and shared by every fork
    import runtime.worker_main  # noqa: F401
    from engine.optimizers import load_lazy_modules  # imported with the worker's modules above

    load_lazy_modules()

    answers = os.dup(1)  # stdout carries the protocol; nothing else may write to it
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    return serve(0, answers, own_name)


if __name__ == "__main__":
    sys.exit(main())

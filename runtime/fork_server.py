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
`"idle": true` once it was the last worker.

Each worker is a session of its own, like a `subprocess.Popen(start_new_session=True)`: stopped
by its pid's process group, never by this process's. This process runs in the run's
environment, so its workers carry the run's tag in `/proc/<pid>/environ` (`coordinator.workers.sweep`);
it names itself `FORK_SERVER_NAME` (`/proc/<pid>/comm`) so a count of the run's workers can
leave it out, and its workers take back the interpreter's name. It exits when its stdin closes
(the coordinator ended or died: its workers go on until stopped or their lease ends) and when
its last worker exited with no request waiting (the next request starts a fresh one).
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import time
from typing import Callable

from core.fast_exit import run_exit_handlers
from core.process_start import mark_forked

FORK_SERVER_NAME = "zooid-forks"
"""This process's name in `/proc/<pid>/comm` (at most 15 bytes)."""

_PR_SET_NAME = 15


def _set_name(name: str) -> None:
    """Set this process's `comm` (what `/proc/<pid>/stat` and `ps -o comm` show)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is cosmetic there
        pass


def _exit_code(status: int) -> int:
    """A wait status as `Popen.returncode` reads it: the exit code, or minus the signal."""
    return os.waitstatus_to_exitcode(status)


class ChildExits:
    """A fork server's wake-up on its children's exits: SIGCHLD writes to a pipe (the
    interpreter's wakeup fd), so one `select` waits for a request and for exits alike."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.w, False)
        signal.set_wakeup_fd(self.w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of exits

    def wait(self, fd) -> bool:
        """Block until `fd` is readable or a child exited (or both); whether `fd` is readable."""
        while True:
            try:
                ready, _, _ = select.select([fd, self.r], [], [])
                break
            except InterruptedError:
                continue
        if self.r in ready:
            try:
                os.read(self.r, 512)
            except BlockingIOError:
                pass
        return fd in ready

    def forget(self) -> None:
        """In a forked child: no wake-up, SIGCHLD as by default, the pipe closed."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self.r)
        os.close(self.w)


def _run_worker(argv: list[str], env: dict[str, str], log: str, own_name: str, started: int,
                keep_fds: tuple[int, ...], exits: ChildExits) -> int:
    """In the forked child: become a fresh worker process in a session of its own, under the
    interpreter's name (then close `started`, which tells the server so), run it, return its
    exit status."""
    import random

    forked_at = time.time()
    os.setsid()
    _set_name(own_name)  # a worker again, not the server, by the time the server answers
    os.close(started)
    exits.forget()
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


def run_as_process(body: Callable[[], int | None]) -> int:
    """Run `body` in a forked child as an interpreter runs a program; its exit status: what
    it returns or a `SystemExit` says (a message printed, as the interpreter does), 1 after an
    uncaught exception (its traceback on stderr); then the exit handlers run, and a Ctrl-C
    ends the process by the signal itself."""
    import traceback

    try:
        code = body() or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    run_exit_handlers()
    if code < 0:  # as an uncaught Ctrl-C ends an interpreter: by the signal itself
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def serve(requests, answers, own_name: str) -> int:
    """Answer start requests from the file descriptor `requests` on `answers` until stdin
    closes, or the last worker exited with no request waiting. The workers take `own_name`,
    the interpreter's name before `main` named this process, back as theirs."""
    exits = ChildExits()
    children: set[int] = set()
    buffer = b""

    def send(message: dict) -> None:
        os.write(answers, (json.dumps(message) + "\n").encode())

    def reap() -> bool:
        """Tell of every worker that exited; True when the last one did with no request
        waiting: its exit message says `idle`, and the server ends at once."""
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                return False
            if pid == 0:
                return False
            children.discard(pid)
            last = not children and not buffer and not select.select([requests], [], [], 0)[0]
            send({"exit": pid, "code": _exit_code(status), **({"idle": True} if last else {})})
            if last:
                return True
        return False

    while True:
        asked = exits.wait(requests)
        if reap():
            return 0
        if asked:
            chunk = os.read(requests, 65536)
            if not chunk:
                return 0
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    request = json.loads(line)
                    started_r, started_w = os.pipe()
                    pid = os.fork()
                except (ValueError, OSError) as exc:
                    send({"error": f"{type(exc).__name__}: {exc}"})
                    continue
                if pid == 0:
                    code = 1
                    try:
                        code = _run_worker(request["argv"], request["env"], request["log"], own_name, started_w,
                                           (requests, answers, started_r), exits)
                    except BaseException:  # before the worker ran: in its log, or this process's
                        import traceback

                        traceback.print_exc()
                    finally:
                        os._exit(code & 0xFF if code >= 0 else 1)
                os.close(started_w)
                os.read(started_r, 1)  # returns once the worker has its own session (or died)
                os.close(started_r)
                children.add(pid)
                send({"pid": pid})  # as `Popen(start_new_session=True)` returns: its session exists


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

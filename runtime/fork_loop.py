"""The loop both fork servers run: wait for a request or a child's exit, tell of each exit,
read the requests, fork a child for each and answer with its pid.

Its two users differ in what a request carries, what the child runs and how an answer looks:
`runtime.fork_server` (the inline run's workers: JSON lines on a pipe, answers on another) and
`flows.flow_forks` (the local stack's flow runs: one Unix-socket connection a request, its
answers on that connection). Each says so in a `ForkServer`, and `serve_forks` runs it.

A child answered is a session of its own, like a `subprocess.Popen(start_new_session=True)`:
the server answers with its pid once the child has called `setsid` and let go of the
server's things (`ForkServer.detach`). The child ends with the status its program gives
(`run_as_process`), never returning into the server's loop.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time
from typing import Any, Callable, Iterable, NoReturn, Protocol

from core.fast_exit import run_exit_handlers


class ForkServer(Protocol):
    """What one fork server says to `serve_forks`. A request and a child's answer channel
    (`to`) are whatever the server makes of them; the loop only hands them back."""

    def receive(self) -> list[Any] | None:
        """The requests waiting at the source (it is readable); None: it closed, the server ends."""

    def detach(self, request: Any, others: Iterable[Any]) -> None:
        """In the child, first (in its own session already): let go of the server's things,
        its source and the other children's answer channels `others`."""

    def run_child(self, request: Any, forked_at: float) -> int:
        """In the child: run what `request` asks (forked at `forked_at`); its exit status."""

    def started(self, request: Any, pid: int) -> Any:
        """Answer that `request`'s child is `pid`; return where its exit is told (`to`)."""

    def failed(self, request: Any, exc: OSError) -> None:
        """Answer that no child could be forked for `request`."""

    def exited(self, pid: int, to: Any, code: int, last: bool) -> bool:
        """Tell `to` that child `pid` ended with `code` (as `Popen.returncode` reads it;
        `last`: no other child runs); True ends the server at once."""

    def finished(self, running: int) -> int | None:
        """After each turn, with `running` children: an exit status to end with, or None."""


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


def serve_forks(source, server: ForkServer) -> int:
    """Fork a child for every request `server` receives from `source` (a descriptor or a
    socket) until the server ends; its exit status."""
    return _ForkLoop(source, server).serve()


class _ForkLoop:
    """One server's loop: its source, its children (pid -> answer channel), their wake-up."""

    def __init__(self, source, server: ForkServer):
        self.source, self.server = source, server
        self.children: dict[int, Any] = {}
        self.exits = ChildExits()

    def serve(self) -> int:
        """Wait, tell of exits, fork for the requests, ask whether to end; again."""
        while True:
            readable = self.exits.wait(self.source)
            if self.reap():
                return 0
            if readable:
                requests = self.server.receive()
                if requests is None:
                    return 0
                for request in requests:
                    self.fork(request)
            code = self.server.finished(len(self.children))
            if code is not None:
                return code

    def reap(self) -> bool:
        """Tell of every child that exited; True when the server ends on one."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return False
            if pid == 0:
                return False
            to = self.children.pop(pid, None)
            if self.server.exited(pid, to, os.waitstatus_to_exitcode(status), not self.children):
                return True
        return False

    def fork(self, request: Any) -> None:
        """Fork `request`'s child; answer with its pid once it is in a session of its own."""
        ready: tuple[int, ...] = ()
        try:
            ready = os.pipe()
            pid = os.fork()
        except OSError as exc:
            for fd in ready:
                os.close(fd)
            self.server.failed(request, exc)
            return
        if pid == 0:
            self.child(request, ready)
        os.close(ready[1])
        os.read(ready[0], 1)  # returns once the child has its own session (or died)
        os.close(ready[0])
        self.children[pid] = self.server.started(request, pid)

    def child(self, request: Any, ready: tuple[int, ...]) -> NoReturn:
        """In the forked child: a session of its own, the server's things let go, the server
        told (`ready` closed), then the server's program run; it ends the process."""
        code = 1
        try:
            forked_at = time.time()
            os.setsid()
            self.server.detach(request, self.children.values())
            for fd in ready:
                os.close(fd)
            self.exits.forget()
            code = self.server.run_child(request, forked_at)
        except BaseException:  # before the program ran: in the child's output, or the server's
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code & 0xFF if code >= 0 else 1)


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

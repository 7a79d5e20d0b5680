"""Start the stack's Prefect flow runs by forking a process that has imported them already.

A process work pool starts every flow run as a fresh `python -m prefect.engine`: on this kind
of machine that is 0.7 s of imports for Prefect, 1.2 s more for the `train` flow (torch, the
planners) and, in each warm worker's flow run, 1.5 s for torch and the engine before it is
ready. A run on the local stack pays that twice in a row: its own flow run, then its workers'.

So the stack (`deployments.stack up`) starts this server once. It imports Prefect's engine
and both flows (`flows.train`, `flows.worker`, the worker's engine) and listens on a Unix
socket, `$ZOOID_FLOW_FORKS`. The pool's command is this module's client
(`python -m flows.flow_forks`, which imports neither Prefect nor torch): it connects, hands
over its standard input, output and error with its environment, working directory and
arguments, and the server forks a child that becomes that process: it takes the client's descriptors and environment and runs
`prefect.engine` (or the module the arguments name) as `__main__`. To Prefect's worker the
client is the flow run's process: its output is the child's, its exit status the child's,
and a signal it gets (SIGTERM, SIGINT: a cancel) is passed on to the child.

- **Nothing outlives the client**: the child holds its end of the client's connection and, if
  the client dies without passing a signal on (SIGKILL), kills its own process group.
- **No stale code**: the server notes the modification times of the project's sources when
  it starts. A request after any of them changed is answered `stale`: the client runs the
  module itself (as the pool would have), and the server, once its last child has exited,
  replaces itself with a fresh one (`os.execv`).
- **No server** (the socket is missing, refused, or the server fails the request): the client
  runs the module itself. A pool command pointed here always works.

Protocol on the socket: the client sends one JSON line `{"argv", "env", "cwd"}` with its
descriptors 0, 1 and 2 attached (SCM_RIGHTS); the server answers `{"pid": N}` (or
`{"stale": true}`, or `{"error": "..."}`), then `{"exit": C}` when the child ends (C as
`subprocess.Popen.returncode` reads it: negative, killed by that signal). The server's loop
(wait, tell of exits, fork, answer) is `runtime.fork_loop`'s, shared with the worker side's
fork server; `_FlowRuns` says what differs here.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

from core.process_start import FLOW_FORKS_VAR, mark_forked

# The client is a fresh interpreter at every flow run's start: it imports the standard library's
# few modules above and `core.process_start`, nothing of the project's server side (the server
# and its child import `runtime.fork_loop` and `threading` where they need them).

DEFAULT_MODULE = "prefect.engine"
"""The module a client runs when its arguments name none: Prefect's flow-run entry point."""

ROOT = Path(__file__).resolve().parent.parent
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals a client passes on to its child."""


# --- the client -----------------------------------------------------------------------------------


def _module_argv(args: list[str]) -> list[str]:
    """`-m module args...` for the child (the default module when `args` names none)."""
    return args if args[:1] == ["-m"] and len(args) > 1 else ["-m", DEFAULT_MODULE, *args]


def run_itself(argv: list[str]) -> None:
    """Become `python <argv>` (the pool's own way: no server to fork from)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv])


def _read_line(conn: socket.socket, buffer: bytearray) -> dict | None:
    while b"\n" not in buffer:
        try:
            chunk = conn.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return None
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


def client(args: list[str]) -> int:
    """Run `args` (`-m module ...`) as a child of the server, or as this process when there
    is none; return the exit status."""
    argv = _module_argv(args)
    path = os.environ.get(FLOW_FORKS_VAR)
    if not path:
        run_itself(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode() + b"\n"
        socket.send_fds(conn, [request], [0, 1, 2])
        buffer = bytearray()
        answer = _read_line(conn, buffer)
    except OSError:
        answer = None
    if not answer or "pid" not in answer:
        conn.close()
        run_itself(argv)  # no server, a stale one, or it could not fork
    child = int(answer["pid"])

    def pass_on(signum, frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in _SIGNALS:
        signal.signal(signum, pass_on)
    while True:
        message = _read_line(conn, buffer)
        if message is None:  # the server died: the child's fate is unknown
            return 1
        if "exit" in message:
            code = int(message["exit"])
            if code < 0:  # as the child ended: by the signal itself
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code


# --- the server -----------------------------------------------------------------------------------


def source_mtimes(root: Path = ROOT) -> dict[str, float]:
    """Modification time of every Python source of the project's packages (what a child
    would run; the tests and benchmarks are not run by a flow)."""
    out = {}
    for top in sorted(root.iterdir()):
        if top.name.startswith(".") or top.name in ("tests", "benchmarks") or not (top / "__init__.py").is_file():
            continue
        for path in top.rglob("*.py"):
            try:
                out[str(path)] = path.stat().st_mtime
            except OSError:
                pass
    return out


class _FlowRuns:
    """The stack's `ForkServer` (`runtime.fork_loop`): a request is one connection on the
    listening socket, with its JSON line and the client's descriptors 0, 1 and 2; its answers
    go back on that connection, which the child keeps to watch its client."""

    def __init__(self, path: str, listener: socket.socket, started_with: dict[str, float]):
        self.path, self.listener, self.started_with = path, listener, started_with
        self.stale = False

    def receive(self) -> list[tuple[socket.socket, dict, list[int]]]:
        """The connection waiting, with its request; none when the request is bad, or when the
        sources changed (answered `stale`: the client runs its module itself)."""
        conn, _ = self.listener.accept()
        try:
            request, fds = _read_request(conn)
        except (OSError, ValueError) as exc:
            print(f"zooid flow forks: a bad request ({type(exc).__name__}: {exc})", flush=True)
            conn.close()
            return []
        if self.stale or source_mtimes() != self.started_with:
            self.stale = True
            _answer(conn, {"stale": True})
            _close(conn, fds)
            return []
        return [(conn, request, fds)]

    def detach(self, request, others) -> None:
        self.listener.close()
        for other in others:
            other.close()

    def run_child(self, request, forked_at: float) -> int:
        conn, message, fds = request
        return _child(conn, message, fds, forked_at)

    def started(self, request, pid: int) -> socket.socket:
        conn, _, fds = request
        for fd in fds:
            os.close(fd)
        _answer(conn, {"pid": pid})
        return conn

    def failed(self, request, exc: OSError) -> None:
        conn, _, fds = request
        _answer(conn, {"error": f"{type(exc).__name__}: {exc}"})
        _close(conn, fds)

    def exited(self, pid: int, conn: socket.socket | None, code: int, last: bool) -> bool:
        """Tell the client its child's exit status."""
        if conn is not None:
            _answer(conn, {"exit": code})
            conn.close()
        return False

    def finished(self, running: int) -> None:
        """Once stale with no child left: replace this process with a fresh server."""
        if self.stale and not running:
            self.listener.close()
            os.unlink(self.path)
            print("zooid flow forks: the project's sources changed; starting afresh", flush=True)
            os.execv(sys.executable, [sys.executable, "-m", "flows.flow_forks", "serve", self.path])


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A client's request line and its three descriptors (OSError or ValueError when bad)."""
    conn.settimeout(5.0)
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not msg.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise OSError("the client left mid-request")
        msg += more
    request = json.loads(msg)
    if len(fds) != 3:
        raise OSError(f"expected 3 descriptors, got {len(fds)}")
    conn.settimeout(None)
    return request, fds


def _close(conn: socket.socket, fds: list[int]) -> None:
    """Let go of a request that gets no child."""
    for fd in fds:
        os.close(fd)
    conn.close()


def _child(conn: socket.socket, request: dict, fds: list[int], forked_at: float) -> int:
    """In the forked child (a session of its own, the server's socket let go): become the
    client's process and run its module; return the status."""
    import runpy
    import threading
    import warnings

    from runtime.fork_loop import run_as_process  # server side: kept off the client's imports

    for signum in _SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    mark_forked(forked_at)  # a clock tick of /proc is as long as this start
    os.chdir(request["cwd"])

    def orphaned() -> None:  # the client is gone without passing a signal on: so is its process
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=orphaned, name="client-watch", daemon=True).start()
    _fresh_settings()
    argv = request["argv"]
    module = argv[1]
    sys.argv = [module, *argv[2:]]
    # imported by the server already (that is the point): runpy warns that it runs a fresh copy
    warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)

    def run() -> None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)

    return run_as_process(run)


def _fresh_settings() -> None:
    """Prefect read its settings from the server's environment when it was imported: read them
    again from this process's, as a fresh `prefect.engine` would have."""
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()


def _preload() -> None:
    """Import once, in the server, what every child would import: shared by every fork."""
    import prefect.engine  # noqa: F401 - a child runs it
    import prefect.flow_engine  # noqa: F401
    # what every flow run's engine imported on first use (with Python's import timing on the
    # stack: 40-60 ms of each child's start, a train run's and each of its workers')
    import anyio._core._sockets  # noqa: F401
    import anyio._core._streams  # noqa: F401
    import encodings.idna  # noqa: F401
    import prefect.task_engine  # noqa: F401
    import prefect.utilities.visualization  # noqa: F401
    import rich._emoji_codes  # noqa: F401
    # what a train flow run's validation imports on first use (the dataset's loader, torch's
    # tracing of a model on `meta`): 0.8 s of every run's start, paid once here instead
    import sklearn.datasets  # noqa: F401
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    # the flows and the worker's engine a child runs
    # (at the top they would weigh on the client, which imports this module too)
    import flows.train  # noqa: F401
    import flows.worker  # noqa: F401
    import runtime.worker_main  # noqa: F401
    from engine.optimizers import load_lazy_modules

    load_lazy_modules()
    # the run's report draws its curves at the end of every train run: 0.2-0.3 s of imports
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def _listen(path: str) -> socket.socket:
    """A socket listening on `path` (whatever was there replaced), this user's alone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old_mask)
    listener.listen(64)
    return listener


def serve(path: str) -> int:
    """Listen on `path` and fork a child for every request (see the module docstring)."""
    import threading

    from runtime.fork_loop import serve_forks  # server side: kept off the client's imports

    _preload()
    if threading.active_count() > 1:  # a thread would not survive a fork: its locks might not either
        print(f"zooid flow forks: the imports started threads ({', '.join(t.name for t in threading.enumerate())}); "
              "not serving", file=sys.stderr, flush=True)
        return 1
    started_with = source_mtimes()
    listener = _listen(path)
    print(f"zooid flow forks: listening on {path} (pid {os.getpid()})", flush=True)
    return serve_forks(listener, _FlowRuns(path, listener, started_with))


def _answer(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        if len(args) != 2:
            print("usage: python -m flows.flow_forks serve SOCKET", file=sys.stderr)
            return 2
        return serve(args[1])
    return client(args)


if __name__ == "__main__":
    sys.exit(main())

"""A spot worker container's process: it keeps the provider's notice until the worker can act on it.

The notice (SIGTERM, the offer's `notice_s` before the SIGKILL: Fargate Spot's 120 s) can come
while the container is still starting: the interpreter, Prefect's engine and the flow run, the
imports of torch and the engine, the store's connection. No handler of the worker's is in place
then (Prefect's, or none), so the worker would die at once and its rank wait for a replacement's
whole start-up, every other worker idle and billed meanwhile. Yet the notice leaves it most of
its grace, and a warm worker works through a notice (`runtime.warm`, `engine.preemption`).

So a spot container's command is this module before the flow run's engine
(`clouds.provider.SPOT_FLOW_RUN_COMMAND`): it runs the engine as its child with
`$ZOOID_NOTICE_DIR` set to a directory of its own, and until the worker says it can take the
notice (`core.notice.ready_for_notice`: the file `ready` there, written once the worker serves
with its notice time, or an epoch listens) a SIGTERM stays here: the relay writes when it came
(`noticed_at`, which the worker's handler reads, `core.notice.take_relayed_notice`, so
its working time counts from the notice, not from its delivery) and passes the signal on once
`ready` exists. A second SIGTERM, and every SIGTERM once the worker is ready, pass on at once,
as do SIGINT and SIGHUP; the SIGKILL at the end of the grace ends both processes whatever
happened. The relay exits with its child's status (128 + N for a child killed by signal N).

The standard library only (and `core.notice`'s names), so that it adds milliseconds to a start:

    python3 -m runtime.notice_relay python3 -m prefect.engine
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from core.notice import NOTICE_DIR_VAR, NOTICED_AT, READY  # (it imports the standard library only)

LOOK_S = 0.1
"""How often the relay looks for `ready` while it keeps a notice (a stat, no request)."""


def write_atomically(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all (a reader never sees half of it)."""
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


class _Kept(Exception):
    """Raised from the SIGTERM handler once it keeps a notice: wakes `Relay.run` from its wait."""


class Relay:
    """The child process and the notice kept from it."""

    def __init__(self, argv: list[str]):
        self.directory = tempfile.mkdtemp(prefix="zooid-notice-")
        self.child = subprocess.Popen(argv, env={**os.environ, NOTICE_DIR_VAR: self.directory})
        self.kept = False

    def ready(self) -> bool:
        return os.path.exists(os.path.join(self.directory, READY))

    def on_term(self, signum, frame) -> None:  # noqa: ARG002 - a signal handler's signature
        """Keep the first notice while the worker is not ready; pass on anything else."""
        if self.child.returncode is not None:
            return
        if self.kept or self.ready():
            self.child.send_signal(signum)
            return
        try:
            write_atomically(os.path.join(self.directory, NOTICED_AT), repr(time.time()))
        except OSError:  # nowhere to keep it: the worker takes it as it comes
            self.child.send_signal(signum)
            return
        self.kept = True
        raise _Kept()

    def pass_on(self, signum, frame) -> None:  # noqa: ARG002 - a signal handler's signature
        if self.child.returncode is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        """Wait for the child (blocked, or looking for `ready` every `LOOK_S` while a notice is
        kept, then passing it on); its exit status."""
        try:
            while True:
                try:
                    if not self.kept:
                        code = self.child.wait()
                        break
                    code = self.child.poll()
                    if code is not None:
                        break
                    if self.ready():
                        self.kept = False
                        self.child.send_signal(signal.SIGTERM)
                        continue
                    time.sleep(LOOK_S)
                except _Kept:
                    continue
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m runtime.notice_relay COMMAND [ARG ...]", file=sys.stderr)
        return 2
    relay = Relay(argv)
    signal.signal(signal.SIGTERM, relay.on_term)
    signal.signal(signal.SIGINT, relay.pass_on)
    signal.signal(signal.SIGHUP, relay.pass_on)
    return relay.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

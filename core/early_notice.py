"""The provider's notice from a worker container's first moment, before any of its code runs.

A container's engine (`python3 -m prefect.engine`, `clouds.provider.FLOW_RUN_COMMAND`) spends its
first seconds importing Prefect, reading its flow run from the API and importing the flow's module
before the worker's own SIGTERM handler is in place (`engine.preemption.leaving`). A spot notice
in those seconds used to end the process at once (the default disposition, passed on by the
container's init), so the start was lost and a replacement had to start from nothing while its
peers waited for it.

The worker images run this module from a `.pth` file (`PTH_NAME`, written by `write_pth` at the
image's build) as the interpreter starts. Where the environment names it (`ENV`, set in the
image), it installs a handler that only records when the notice came, and removes `ENV` from the
environment so that no process the worker starts inherits the handler. `engine.preemption` takes
the recorded notice (`take`) where a worker begins to act on notices: a warm worker that works
through its notice starts and serves until it is released, any other worker hands over at its
epoch's first step boundary or leaves at once, as if the notice had come then.

Standard library only: it runs in every interpreter of the image, before anything else.
"""
from __future__ import annotations

import os
import signal
import sys
import time

ENV = "ZOOID_EARLY_NOTICE"
"""Set (to 1) in a worker image: the next interpreter started there records an early notice."""
PTH_NAME = "zooid_notice.pth"
"""The `.pth` file that runs this module (after `zooid.pth`, which puts the project on the path)."""

_at = 0.0
"""Unix time of the notice recorded before the worker's handler was in place (0: none)."""


def _record(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    global _at
    if not _at:
        _at = time.time()


def install() -> bool:
    """Record a SIGTERM from now on, where `ENV` is set (and take `ENV` out of the environment);
    returns whether it installed the handler."""
    if not os.environ.pop(ENV, ""):
        return False
    try:
        signal.signal(signal.SIGTERM, _record)
    except ValueError:  # not the main thread: an embedded interpreter
        return False
    return True


def take() -> float:
    """When a notice came before the worker's handler was in place (0: none), once: the caller
    acts on it from here on."""
    global _at
    at, _at = _at, 0.0
    return at


def write_pth(site_dir: str) -> str:
    """Write the `.pth` file that runs `install()` as each interpreter of `site_dir` starts."""
    path = os.path.join(site_dir, PTH_NAME)
    with open(path, "w") as f:
        f.write("import core.early_notice; core.early_notice.install()\n")
    return path


if __name__ == "__main__":  # `python3 -m core.early_notice SITE_DIR`: the image's build
    print(write_pth(sys.argv[1]))

"""End a command's process without the interpreter's own teardown.

`sys.exit` in a process that imported torch and Prefect spends about 0.7 s (measured on a
coordinator here) freeing every object and module one by one after the program is done: a
user waits through it at the end of every command, and a worker is billed for it. The
program's own end is kept: its non-daemon threads are waited for and the `atexit` handlers
run (logging flushes and closes its handlers there), then the standard streams are flushed,
then the process ends with the status `sys.exit` would give. Files left open and unflushed
would lose their buffers; Zooid writes its files in `with` blocks.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """`sys.exit(code)` less the interpreter's teardown (see the module docstring)."""
    # what the interpreter does first at its end: the callbacks threads registered for it (an
    # idle ThreadPoolExecutor's workers are told to stop there; joining them before would wait
    # forever), then every non-daemon thread joined
    threading._shutdown()
    run_exit_handlers()
    os._exit(0 if code is None else code)


def run_exit_handlers() -> None:
    """What a program's end does before the interpreter's teardown: the `atexit` handlers, then
    the standard streams flushed (a forked worker, which ends by `os._exit`, does it too)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass

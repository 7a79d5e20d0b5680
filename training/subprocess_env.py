"""The environment of a probe or worker process the project starts itself."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_thread_env() -> dict[str, str]:
    """This process's environment with one OpenMP/MKL thread, as workers run, and the
    repository importable (`python -m training....` from any working directory)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def exit_when_orphaned(parent_pid: int, interval_s: float = 0.5) -> threading.Thread:
    """Watch, from a daemon thread, that `parent_pid` is still this process's parent, and end
    the process (exit status 1) once it is not: the parent died and the process was handed
    to init. A probe rank started in its own session (so that its parent can stop it by
    process group) would otherwise run on until its store waits time out."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="exit-when-orphaned", daemon=True)
    thread.start()
    return thread

"""Worker processes for the engine tests, forked ready-imported as an inline run starts its
workers (`coordinator.workers.worker_forks`), from one fork server per test process, instead of
a fresh interpreter each (whose imports cost 2-3 s of CPU here: 66 such starts were 9 % of the
suite's CPU). A forked worker is a process of its own, in a session of its own, that answers
`pid`, `poll()`, `wait()` and `returncode` as `subprocess.Popen` does
(`tests/test_worker_forks.py` holds it to a started process's exit status and output); the
tests that hold the command line itself (`python -m runtime.worker_main`) still start it."""
from __future__ import annotations

import atexit
import json
import os
import tempfile
from pathlib import Path

from coordinator.workers.worker_forks import ForkedWorker, WorkerForks
from core.specs import WorkerSpec

_forks: WorkerForks | None = None


def start_worker(spec: WorkerSpec, env: dict[str, str], log: Path) -> ForkedWorker:
    """`python -m runtime.worker_main --spec-json <spec>` in `env` (the worker's whole
    environment), its output in `log`, forked from this process's fork server."""
    global _forks
    if _forks is None:
        out = Path(tempfile.gettempdir()) / f"zooid-test-forks-{os.getpid()}.out"
        _forks = WorkerForks(dict(os.environ), out)
        atexit.register(_forks.close)
    proc = _forks.start(["--spec-json", json.dumps(spec.to_dict())], dict(env), Path(log))
    assert proc is not None, "the tests' fork server could not start a worker"
    return proc

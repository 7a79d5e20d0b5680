"""The environment of a probe or worker process the project starts itself."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_thread_env() -> dict[str, str]:
    """This process's environment with one OpenMP/MKL thread, as workers run, and the
    repository importable (`python -m training....` from any working directory)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

"""The train command as a benchmark runs it, with the one parameter encoding, and the digits job.

Parameters travel as `make run PARAMS=...` and `python -m flows.train` take them: one
`--param NAME=VALUE` per TrainJob field, a string as it is and anything else as JSON
(`coordinator.run.job.parse_param_value` reads them back).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.home import REPO

DIGITS_BATCH, DIGITS_LR = 16, 0.05
"""The digits job's batch per worker and learning rate (`digits_job`)."""


def digits_job(workers: int, epochs: int, warm: bool, **overrides) -> dict:
    """The benchmarks' small job as TrainJob fields: digits, `digits_mlp`, Local-SGD once per
    epoch, batch 16 per worker, SGD with momentum lr 0.05, static scaling, seed 0; `overrides`
    replace or add fields."""
    return {"model": "digits_mlp", "dataset": "digits", "workers": workers, "epochs": epochs,
            "batch_size": DIGITS_BATCH, "lr": DIGITS_LR, "optimizer": "momentum", "strategy": "local_sgd",
            "scaling": "static", "seed": 0, "warm": warm, **overrides}


def param_args(params: dict) -> list[str]:
    """`--param NAME=VALUE` for each of `params` (TrainJob fields)."""
    return [arg for name, value in params.items()
            for arg in ("--param", f"{name}={value if isinstance(value, str) else json.dumps(value)}")]


def train_command(params: dict, summary_out: Path) -> list[str]:
    """`python -m flows.train` with `params`, writing the run's summary to `summary_out`."""
    return [sys.executable, "-m", "flows.train", *param_args(params), "--summary-out", str(summary_out)]


@dataclass(frozen=True)
class TrainRun:
    """One train command: the run's summary, when it was spawned (`time.time()`) and its wall
    seconds, spawn to exit (imports, the temporary server and teardown included)."""

    summary: dict
    began: float
    wall_s: float


def run_train(params: dict, summary_out: Path, *, env: dict | None = None, timeout_s: float = 900) -> TrainRun:
    """Run the train command with `params` from the repository root (in `env`, default this
    process's); RuntimeError with its output's tail when it fails or writes no summary."""
    summary_out = Path(summary_out)
    summary_out.unlink(missing_ok=True)
    began = time.time()
    proc = subprocess.run(train_command(params, summary_out), env=os.environ if env is None else env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    wall = time.time() - began
    if proc.returncode != 0 or not summary_out.exists():
        raise RuntimeError(f"python -m flows.train failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return TrainRun(json.loads(summary_out.read_text()), began, wall)

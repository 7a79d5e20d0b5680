"""Record the report tests' inputs from real runs: `python tests/golden/record.py [name ...]`.

Each run is a real command-line run (`python -m flows.train`, the inline target) in a
temporary Zooid home of its own (its own store and its own temporary Prefect server);
its `summary.json` and `cost.json` are copied here as `<name>.summary.json` and
`<name>.cost.json`, the inputs `tests/test_report.py` renders. Then
`ZOOID_UPDATE_GOLDEN=1 pytest tests/test_report.py` rewrites the golden renderings from them
(read the diff before committing both). The runs:

- `local_sgd`: two workers, two epochs of Local-SGD;
- `pipeline`: two stages of one replica, four micro-batches, two epochs, rank 1 crashed in its
  second epoch (`ZOOID_CHAOS`) and relaunched;
- `cancelled`: two workers, a long job stopped by SIGTERM while its rank 0 is held at the
  start of epoch 1 (the held worker's marker is the event the script waits on).

Wall times, dates, pids and the temporary store's path are whatever the recording run had;
once recorded they are fixed, so the renderings are too.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent
ROOT = GOLDEN.parents[1]
COMMON = {"batch_size": 32, "lr": 0.05, "optimizer": "momentum", "seed": 0}
RUNS: dict[str, dict] = {
    "local_sgd": {"params": {"strategy": "local_sgd", "workers": 2, "epochs": 2}},
    "pipeline": {"params": {"strategy": "pipeline", "stages": 2, "microbatches": 4, "epochs": 2},
                 "chaos": "crash_worker:epoch=1:rank=1:attempt=0"},
    "cancelled": {"params": {"strategy": "local_sgd", "workers": 2, "epochs": 50},
                  "chaos": "hold_worker:epoch=1:rank=0:until=never:seconds=600", "stop_when_held": (1, 0)},
}
TIMEOUT_S = 600


def record(name: str) -> None:
    """Run `name` in a fresh home and copy its summary and ledger into tests/golden/."""
    spec = RUNS[name]
    with tempfile.TemporaryDirectory(prefix=f"zooid-golden-{name}-") as tmp:
        home = Path(tmp) / "zooid"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "ZOOID_"))}
        env.update(ZOOID_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
        if spec.get("chaos"):
            env["ZOOID_CHAOS"] = spec["chaos"]
        argv = [sys.executable, "-m", "flows.train"]
        for key, value in {**COMMON, **spec["params"]}.items():
            argv += ["--param", f"{key}={value}"]
        log = Path(tmp) / "run.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                if "stop_when_held" in spec:
                    epoch, rank = spec["stop_when_held"]
                    _wait_for(home / "store" / "runs", f"*/faults/held-e{epoch}-r{rank}-*", proc)
                    proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=TIMEOUT_S)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        runs = sorted((home / "store" / "runs").glob("*/summary.json"))
        if len(runs) != 1:
            sys.exit(f"{name}: expected one run's summary.json, found {len(runs)}; its log:\n"
                     f"{log.read_text(errors='replace')[-4000:]}")
        run = runs[0].parent
        for part in ("summary", "cost"):
            shutil.copyfile(run / f"{part}.json", GOLDEN / f"{name}.{part}.json")
        print(f"{name}: run {run.name} exited {proc.returncode}; wrote {name}.summary.json and {name}.cost.json")


def _wait_for(root: Path, pattern: str, proc: subprocess.Popen) -> None:
    """Until a file matching `pattern` exists under `root` (an event the run writes)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (root.exists() and any(root.glob(pattern))):
        if proc.poll() is not None:
            sys.exit(f"the run ended (exit {proc.returncode}) before {pattern} appeared")
        if time.monotonic() > deadline:
            sys.exit(f"no {pattern} under {root} after {TIMEOUT_S} s")
        time.sleep(0.1)


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"unknown run {unknown[0]!r}; valid: {', '.join(RUNS)}")
    for name in names or list(RUNS):
        record(name)


if __name__ == "__main__":
    main(sys.argv[1:])

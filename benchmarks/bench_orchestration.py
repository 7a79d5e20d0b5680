"""Orchestration overhead per epoch: the inline target next to the process pool, measured in one run.

For 1, 2, 4 and 8 workers, trains digits for two epochs on each target and measures, per
epoch, the time from the start of `run_epoch` until every worker computes, and its share
of the epoch:

- inline: `python -m flows.train --param target=inline ...` as a subprocess; the
  coordinator starts each worker as a plain process (`training.worker_main`);
- pool: `deployments.stack.up(home=...)`, then `run_deployed` of `train/local`, whose
  coordinator starts one `worker` flow run per worker on the `zooid-local` process pool
  (`run_deployment`; the Prefect worker polls every second and forks a flow-run process).

Both targets talk to the same Prefect server (the stack's), so the inline runs do not pay
for a temporary server; the server is not on the epoch's path for inline workers anyway.

Timestamps, all Unix time on this one machine:

- t0, the start of run_epoch's launches: the epoch's last worker stop in the ledger
  (`runs/<id>/cost.json`) minus the epoch's `seconds` in the summary, which run_epoch
  measures from that very instant to the last worker stop;
- launched: the last worker's launch (ledger row `start`, taken when Popen /
  run_deployment returned);
- started: when the worker's process built its model, the first thing a worker does after
  its imports and spec parsing (the same instant as `WorkerResult.started_at`, within ms);
- computing: when the worker's first training forward pass began.

`WorkerResult` reports started_at but not the first step, so the job trains
`benchmarks.bench_orchestration:timed_digits_mlp`: digits_mlp (same layers, same weights
from the same seed) whose factory and first training forward append their time to
`$ZOOID_HOME/probe/<pid>.txt`. A probe line is attributed to the epoch whose window
[t0, last stop] contains it; each epoch must show exactly one probe per worker.

Overhead = max over workers of computing - t0; share = overhead / epoch seconds.

    .venv/bin/python -m benchmarks.bench_orchestration [--workers 1 2 4 8] [--epochs 2]
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from torch import nn

from benchmarks.output import write_result

RESULTS = Path(__file__).resolve().parent / "results" / "orchestration.md"
PROBE_MODEL = "benchmarks.bench_orchestration:timed_digits_mlp"

# --- the probe: runs inside worker processes, so it imports nothing heavy -----------------

_recorded: set[str] = set()


def _probe(kind: str) -> None:
    """Append `kind time` to $ZOOID_HOME/probe/<pid>.txt, once per kind and process."""
    home = os.environ.get("ZOOID_HOME")
    if not home or kind in _recorded:
        return
    _recorded.add(kind)
    now = time.time()
    folder = Path(home) / "probe"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{os.getpid()}.txt", "a") as fh:
        fh.write(f"{kind} {now:.6f}\n")


def _on_forward(module: nn.Module, args) -> None:
    # Only a training forward counts: rank 0's evaluation runs in eval mode after the loop.
    if module.training:
        _probe("first_step")


def timed_digits_mlp() -> nn.Module:
    """digits_mlp that records when it is built and when its first training step begins."""
    from training.models import digits_mlp

    _probe("built")
    model = digits_mlp()
    model.register_forward_pre_hook(_on_forward)
    return model


# --- reading what a run left behind ------------------------------------------------------

def read_probes(home: Path) -> dict[int, dict[str, float]]:
    """{pid: {kind: unix time}} from the probe files under `home`."""
    out: dict[int, dict[str, float]] = {}
    for f in (home / "probe").glob("*.txt"):
        events = {}
        for line in f.read_text().splitlines():
            kind, _, t = line.partition(" ")
            events[kind] = float(t)
        out[int(f.stem)] = events
    return out


def epoch_overheads(target: str, summary: dict, ledger: dict, probes: dict[int, dict[str, float]]) -> list[dict]:
    """One row per epoch: t0-relative launched/started/computing times and the share."""
    rows = []
    for ep in summary["epochs"]:
        e = ep["epoch"]
        workers = [r for r in ledger["rows"] if r.get("epoch") == e and r["kind"] == "worker"]
        end = max(r["stop"] for r in workers)
        t0 = end - ep["seconds"]
        inside = [p for p in probes.values() if "first_step" in p and t0 <= p["first_step"] <= end]
        if len(inside) != ep["workers"]:
            raise RuntimeError(f"{target} epoch {e}: {len(inside)} probes for {ep['workers']} workers")
        computing = max(p["first_step"] for p in inside) - t0
        rows.append({
            "target": target, "workers": ep["workers"], "epoch": e, "epoch_s": ep["seconds"],
            "launched_s": max(r["start"] for r in workers) - t0,
            "started_s": max(p["built"] for p in inside) - t0,
            "overhead_s": computing, "share": computing / ep["seconds"],
            "val_accuracy": ep["val_accuracy"],
        })
    return rows


def read_run(home: Path, run_id: str) -> dict:
    """The ledger a run wrote to the directory store under `home`."""
    import json

    return json.loads((home / "store" / "runs" / run_id / "cost.json").read_text())


# --- running the two targets -------------------------------------------------------------

def job_params(workers: int, epochs: int) -> dict:
    """The benchmark's job: digits, Local-SGD once per epoch, batch 16, fixed worker count."""
    return {"model": PROBE_MODEL, "dataset": "digits", "workers": workers, "epochs": epochs,
            "batch_size": 16, "strategy": "local_sgd", "scaling": "static", "seed": 0}


def run_inline(params: dict, stack_env: dict, home: Path) -> tuple[dict, dict]:
    """`python -m flows.train` (target inline) against the stack's server, store under `home`."""
    import json
    import subprocess
    import sys

    from deployments.stack import ROOT

    out = home / f"summary-{params['workers']}.json"
    argv = [sys.executable, "-m", "flows.train", "--summary-out", str(out), "--param", "target=inline"]
    argv += [a for k, v in params.items() for a in ("--param", f"{k}={v}")]
    env = {**os.environ, **stack_env, "ZOOID_HOME": str(home)}
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"inline run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads(out.read_text())
    return summary, read_run(home, summary["run_id"])


def run_pool(params: dict, home: Path) -> tuple[dict, dict]:
    """`train/local` on the stack's process pool (the stack must be up under `home`)."""
    from deployments.stack import run_deployed

    summary = run_deployed({**params, "target": "local"}, home=home, timeout_s=600)
    if summary.get("flow_run_state") != "COMPLETED":
        raise RuntimeError(f"pool run ended {summary.get('flow_run_state')}: {summary.get('error')}")
    return summary, read_run(home, summary["run_id"])


# --- report ------------------------------------------------------------------------------

def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def render(rows: list[dict], command: str, machine: str, elapsed_s: float) -> str:
    """Markdown: a side-by-side table of per-epoch means, then every epoch."""
    lines = [
        "# Orchestration overhead per epoch: inline target vs process pool",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}. Whole benchmark: {elapsed_s:.0f} s.",
        "",
        "Job: digits, `timed_digits_mlp` (digits_mlp plus a timing probe), Local-SGD once per epoch, "
        "batch 16, SGD with momentum, 2 epochs per run. Overhead = from the start of `run_epoch`'s "
        "launches (t0) until the last worker begins its first training step; share = overhead / "
        "epoch wall time (t0 to the last worker's exit). Times in seconds, mean of the run's epochs.",
        "",
        "| workers | inline overhead | inline share | inline epoch | pool overhead | pool share | pool epoch | pool / inline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {}
    for r in rows:
        by.setdefault((r["target"], r["workers"]), []).append(r)
    for w in sorted({r["workers"] for r in rows}):
        i, p = by.get(("inline", w), []), by.get(("pool", w), [])
        cells = [str(w)]
        for group in (i, p):
            if group:
                cells += [f"{_mean([r['overhead_s'] for r in group]):.2f}",
                          f"{100 * _mean([r['share'] for r in group]):.0f} %",
                          f"{_mean([r['epoch_s'] for r in group]):.2f}"]
            else:
                cells += ["-", "-", "-"]
        ratio = (_mean([r["overhead_s"] for r in p]) / _mean([r["overhead_s"] for r in i])) if i and p else None
        cells.append(f"{ratio:.1f}x" if ratio else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Every epoch. launched = the last worker's launch returned (Popen, or run_deployment "
        "created its flow run); started = the last worker process built its model (after its "
        "imports; = `WorkerResult.started_at` within ms); computing = the last worker's first "
        "training step (the overhead). All relative to t0.",
        "",
        "| target | workers | epoch | launched | started | computing | epoch s | share | val acc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["workers"], r["target"], r["epoch"])):
        lines.append(f"| {r['target']} | {r['workers']} | {r['epoch']} | {r['launched_s']:.2f} | "
                     f"{r['started_s']:.2f} | {r['overhead_s']:.2f} | {r['epoch_s']:.2f} | "
                     f"{100 * r['share']:.0f} % | {r['val_accuracy']:.3f} |")
    return "\n".join(lines) + "\n"


def machine_note() -> str:
    """CPU count and load, because 8 workers here share 2 cores with other people's work."""
    import platform

    load = os.getloadavg()
    return (f"{os.cpu_count()} CPU cores ({platform.machine()}), shared with other jobs "
            f"(load average {load[0]:.1f} at the end); 8 workers share those cores, so their start "
            "times include waiting for CPU")


def main(argv: list[str] | None = None) -> int:
    """Run both targets for each worker count, alternating, and write the markdown."""
    import argparse
    import socket
    import tempfile

    from deployments.stack import down, up

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_orchestration",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (stores, logs, probes)")
    args = parser.parse_args(argv)

    began = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="zooid-bench-orch-"))
    stack_home, inline_home = base / "stack", base / "inline"
    inline_home.mkdir(parents=True)
    rows: list[dict] = []
    # Any free port, never the stack's preferred 4200, so a developer's `make up` keeps it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = up(home=stack_home, port=port)
    try:
        for w in args.workers:
            params = job_params(w, args.epochs)
            for target in ("inline", "pool"):
                if target == "inline":
                    summary, ledger = run_inline(params, state["env"], inline_home)
                    probes = read_probes(inline_home)
                else:
                    summary, ledger = run_pool(params, stack_home)
                    probes = read_probes(stack_home)
                got = epoch_overheads(target, summary, ledger, probes)
                rows += got
                print(f"{target:6s} workers={w}: " + ", ".join(
                    f"e{r['epoch']} overhead {r['overhead_s']:.2f} s of {r['epoch_s']:.2f} s" for r in got),
                    flush=True)
    finally:
        down(stack_home)
    command = ".venv/bin/python -m benchmarks.bench_orchestration" + (
        f" --workers {' '.join(map(str, args.workers))}" if args.workers != [1, 2, 4, 8] else "") + (
        f" --epochs {args.epochs}" if args.epochs != 2 else "")
    text = render(rows, command, machine_note(), time.monotonic() - began)
    write_result(args.out, text, echo=True)
    if args.keep:
        print(f"scratch kept in {base}")
    else:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

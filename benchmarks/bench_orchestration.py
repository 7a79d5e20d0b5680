"""Orchestration overhead per epoch: warm vs cold workers, inline and on the process pool.

One run measures, against one local Prefect stack (`deployments.stack.up` on a free port,
scratch home; the stack's Prefect worker polls the `zooid-local` process pool):

1. Warm vs cold workers, for 1, 2, 4 and 8 workers (`--workers`), `--epochs` (default 3)
   epochs per run, on two targets:

   - inline: `python -m flows.train --param target=inline ...` as a subprocess talking to
     the stack's server; the coordinator starts workers as plain processes;
   - pool: `run_deployment("train/local", ...)`, whose coordinator starts its workers as
     flow runs on the process pool.

   `--param warm=true`: one long-lived worker per rank serves every epoch (it imports,
   builds the model and reads its data once); `warm=false`: a new worker process per
   epoch (with the job's default pre-start). Job: digits, `digits_mlp`, Local-SGD averaged
   once per epoch, batch 16 per worker, SGD with momentum, lr 0.05, seed 0.

   Per epoch, from the run's summary (`EpochSummary`): wall = `seconds` (coordinator
   clock, from sending the epoch's work to the last worker's reply); busy =
   `critical_busy_s`, the slowest worker's compute + sync seconds (its training loop;
   `compute_s + sync_s`, the maxima over workers, where a summary lacks the field);
   overhead = wall - busy, i.e. everything the epoch spends outside the slowest worker's
   training loop: launching or commanding workers, imports, model build, data reads,
   rank 0's validation pass, the reply's trip back; share = overhead / wall.
   Summary per (target, mode, workers): epoch 0's overhead (a warm run's workers start
   there), the median overhead, wall and share over epochs 1.., and cold / warm overhead.
   Goal: warm overhead <= 0.5 s (median, epochs 1..) at 4 workers on the pool.

2. A long epoch (skip with `--no-long`): `long_mlp` below (64 -> 1024 -> 1024 -> 1024 ->
   10) on `synthetic:64:10:N:512`, batch 64, 2 warm workers on the pool, 3 epochs; N is
   chosen so one epoch computes about 10-15 s on 2 shared cores. Goal: overhead <= 5 % of
   the epoch's wall (median over epochs 1..).

3. A whole run (skip with `--no-whole-run`): the digits job above, 2 warm workers, 20
   epochs on the pool (stack already up), timed from submitting `train/local` to seeing
   the flow run final (polled every 0.1 s), plus the flow run's own start -> end from
   Prefect; beside plain PyTorch in a fresh process (`python -m
   benchmarks.bench_orchestration --plain 20`, timed from spawn to exit, imports
   included): the same digits training split, `digits_mlp` from seed 0, SGD momentum 0.9,
   lr 0.05, batch 32 (= 2 workers x 16, the same global batch, so the same 45 steps per
   epoch), a validation pass per epoch like Zooid's rank 0, torch's default threads.

    .venv/bin/python -m benchmarks.bench_orchestration [--workers 1 2 4 8] [--epochs 3]
        [--no-long] [--no-whole-run] [--out PATH] [--keep]
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from torch import nn

from benchmarks.harness.home import REPO, scratch
from benchmarks.harness.overhead import DETAIL, epoch_rows, summarise_rows
from benchmarks.harness.stack import local_stack, pool_summary
from benchmarks.harness.tables import fmt, pct, table
from benchmarks.harness.train import DIGITS_BATCH, DIGITS_LR, digits_job, run_train
from benchmarks.output import HOST_SOURCE, provenance, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "orchestration.md"
SOURCES = (*HOST_SOURCE, "benchmarks/harness/stack.py", "benchmarks/harness/replicas.py",
           "benchmarks/harness/train.py", "benchmarks/harness/overhead.py", "benchmarks/harness/tables.py")
"""The code it measures (the whole project but the worker image's recipe, its workers being processes here: the
train flow on the local stack): its results file is stale once one of these changed since the commit the file
names (`benchmarks.staleness`)."""
TITLE = "Orchestration overhead per epoch: warm vs cold workers, inline and process pool"

DEFAULT_WORKERS = [1, 2, 4, 8]
DEFAULT_EPOCHS = 3
GOAL_WARM_OVERHEAD_S = 0.5
GOAL_WARM_WORKERS = 4
GOAL_LONG_SHARE = 0.05

LONG_MODEL = "benchmarks.bench_orchestration:long_mlp"
LONG_HIDDEN = 1024
LONG_BATCH = 64
LONG_SAMPLES = 100_000  # 782 steps of 64 per worker: about 11-12 s of compute per epoch on 2 quiet cores
LONG_VAL = 512
LONG_WORKERS = 2
LONG_EPOCHS = 3

WHOLE_WORKERS = 2
WHOLE_EPOCHS = 20
WHOLE_BATCH = DIGITS_BATCH
WHOLE_LR = DIGITS_LR


# --- the long epoch's model: imported by worker processes, so this module stays light ----

def long_mlp(in_features: int = 64, hidden: int = LONG_HIDDEN, classes: int = 10) -> nn.Sequential:
    """64 -> 1024 -> 1024 -> 1024 -> 10 ReLU perceptron (2.2 M parameters): enough compute
    per sample for a long epoch on small 64-feature rows, with a sync of a few MB."""
    return nn.Sequential(
        nn.Linear(in_features, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


# --- jobs and the two targets ------------------------------------------------------------

def long_params(samples: int, batch: int, epochs: int = LONG_EPOCHS) -> dict:
    """The long-epoch job: `long_mlp` on synthetic data, 2 warm workers."""
    return digits_job(LONG_WORKERS, epochs, True, model=LONG_MODEL,
                      dataset=f"synthetic:64:10:{samples}:{LONG_VAL}", batch_size=batch)


def run_inline(params: dict, home: Path, timeout_s: float = 900) -> dict:
    """`python -m flows.train` (target inline) against the stack's server (its environment is
    this process's), store under `home`; returns the run's summary plus `wall_s` (the
    subprocess, spawn to exit)."""
    run = run_train({"target": "inline", **params}, home / f"summary-{time.time_ns()}.json",
                    env={**os.environ, "ZOOID_HOME": str(home)}, timeout_s=timeout_s)
    return {**run.summary, "wall_s": run.wall_s}


# --- plain PyTorch, for the whole-run comparison ----------------------------------------

def plain_pytorch(epochs: int, batch_size: int, lr: float, seed: int = 0) -> dict:
    """Train digits_mlp on the digits training split in this process: SGD momentum 0.9,
    `batch_size`, ceil(n / batch) steps per epoch over a seeded permutation, a validation
    pass per epoch. Returns seconds (loop only) and the last validation accuracy."""
    import math

    import torch
    import torch.nn.functional as F

    from engine.datasets import load_dataset
    from engine.models import build_model

    began = time.perf_counter()
    data = load_dataset("digits")
    model = build_model("digits_mlp", seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    n = len(data.train_y)
    steps = math.ceil(n / batch_size)
    loop = time.perf_counter()
    acc = None
    for _ in range(epochs):
        model.train()
        order = torch.randperm(n, generator=g)
        for s in range(steps):
            idx = order[s * batch_size:(s + 1) * batch_size]
            loss = F.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            acc = (model(data.val_x).argmax(1) == data.val_y).float().mean().item()
    end = time.perf_counter()
    return {"setup_s": loop - began, "loop_s": end - loop, "steps_per_epoch": steps,
            "epochs": epochs, "batch_size": batch_size, "val_accuracy": acc, "threads": torch.get_num_threads()}


def run_plain(epochs: int, batch_size: int, lr: float) -> dict:
    """`plain_pytorch` in a fresh interpreter, timed from spawn to exit (imports included)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "benchmarks.bench_orchestration", "--plain", str(epochs),
            "--plain-batch", str(batch_size), "--plain-lr", str(lr)]
    began = time.time()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    wall = time.time() - began
    if proc.returncode != 0:
        raise RuntimeError(f"plain run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


# --- report ------------------------------------------------------------------------------

def render(rows: list[dict], long_rows: list[dict] | None, long_info: dict | None, whole: dict | None,
           epochs: int) -> str:
    """The markdown below the header: goal lines, summary table, every epoch, the long epoch, the whole run."""
    lines = [f"Job: digits, `digits_mlp`, Local-SGD averaged once per epoch, batch 16 per worker, SGD "
             f"momentum 0.9, lr 0.05, {epochs} epochs per run; `warm=true` keeps one worker process per "
             "rank for the whole run, `warm=false` starts new workers every epoch (default pre-start on). "
             "inline = `python -m flows.train --param target=inline` (workers are plain processes); "
             "pool = `train/local` on the `zooid-local` process pool (workers are flow runs). "
             "Per epoch: wall = the summary's `seconds` (work sent to last reply, coordinator clock); "
             "busy = `critical_busy_s` (slowest worker's compute + sync); overhead = wall - busy; "
             "share = overhead / wall. Times in seconds.", ""]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["target"], r["mode"], r["workers"]), []).append(r)
    stats = {k: summarise_rows(v) for k, v in groups.items()}

    goal = stats.get(("pool", "warm", GOAL_WARM_WORKERS))
    if goal is None or goal["overhead_s"] is None:
        lines.append(f"Goal (warm, {GOAL_WARM_WORKERS} workers, pool, median overhead from epoch 1 on "
                     f"<= {GOAL_WARM_OVERHEAD_S} s): not measured in this run.")
    else:
        ok = goal["overhead_s"] <= GOAL_WARM_OVERHEAD_S
        lines.append(f"Goal (warm, {GOAL_WARM_WORKERS} workers, pool, median overhead from epoch 1 on "
                     f"<= {GOAL_WARM_OVERHEAD_S} s): **{'met' if ok else 'missed'}**, "
                     f"{goal['overhead_s']:.2f} s over {goal['epochs_after_first']} epoch(s).")
    if long_info is not None:
        s = long_info["stats"]
        if s["share"] is None:
            lines.append(f"Goal (long epoch, overhead <= {100 * GOAL_LONG_SHARE:.0f} % of wall): not measured.")
        else:
            ok = s["share"] <= GOAL_LONG_SHARE
            lines.append(f"Goal (long epoch, overhead <= {100 * GOAL_LONG_SHARE:.0f} % of wall, median "
                         f"from epoch 1 on): **{'met' if ok else 'missed'}**, {pct(s['share'])}.")
    lines += ["", "## Summary", "",
              "Epoch 0 separately (a warm run starts its workers there); the rest are medians over "
              "epochs 1.. . cold / warm = cold's median overhead over warm's, same target and workers.", "",
              *table(["target", "workers", "mode", "epoch 0 overhead", "overhead (1..)", "wall (1..)", "share (1..)",
                      "cold / warm"])]
    for target in ("inline", "pool"):
        for w in sorted({k[2] for k in groups}):
            for mode in ("warm", "cold"):
                s = stats.get((target, mode, w))
                if s is None:
                    continue
                ratio = "-"
                if mode == "cold":
                    wm = stats.get((target, "warm", w))
                    if wm and wm["overhead_s"] and s["overhead_s"] is not None and wm["overhead_s"] > 0:
                        ratio = f"{s['overhead_s'] / wm['overhead_s']:.1f}x"
                lines.append(f"| {target} | {w} | {mode} | {fmt(s['epoch0_overhead_s'])} | {fmt(s['overhead_s'])} | "
                             f"{fmt(s['wall_s'])} | {pct(s['share'])} | {ratio} |")
    lines += ["", "## Every epoch", "",
              "new procs = worker processes (by pid) not present the epoch before (warm runs only; "
              "0 means every rank was served by the same process as before).", "",
              *table(["target", "mode", "workers", "epoch", "wall s", "busy s", "overhead s", "share", "new procs",
                      "val acc"])]
    for r in rows:
        lines.append(_row(r))
    if long_info is not None:
        lines += ["", "## Long epoch", "",
                  f"Model `{LONG_MODEL}` ({long_info['params']:,} parameters), dataset "
                  f"`{long_info['params_job']['dataset']}`, batch {long_info['params_job']['batch_size']} per "
                  f"worker, {LONG_WORKERS} warm workers on the pool, {long_info['params_job']['epochs']} epochs. "
                  f"Median from epoch 1 on: overhead {fmt(long_info['stats']['overhead_s'])} s of "
                  f"{fmt(long_info['stats']['wall_s'])} s wall, share {pct(long_info['stats']['share'])}; "
                  f"epoch 0 overhead {fmt(long_info['stats']['epoch0_overhead_s'])} s "
                  f"of {fmt(long_info['stats']['epoch0_wall_s'])} s.", "",
                  *table(["target", "mode", "workers", "epoch", "wall s", "busy s", "overhead s", "share",
                          "new procs", "val acc"])]
        lines += [_row(r) for r in long_rows or []]
    if whole is not None:
        z, p = whole["zooid"], whole["plain"]
        submit_done = z["seen_final_at"] - z["submitted_at"]
        flow = (z["flow_end_at"] - z["flow_start_at"]) if z["flow_start_at"] and z["flow_end_at"] else None
        in_epochs = sum(float(e["seconds"]) for e in z["epochs"])
        lines += ["", "## Whole run: Zooid vs plain PyTorch", "",
                  f"digits, `digits_mlp`, {WHOLE_EPOCHS} epochs. Zooid: `train/local` on the pool (stack "
                  f"already up), {WHOLE_WORKERS} warm workers x batch {WHOLE_BATCH}, Local-SGD once per "
                  f"epoch, momentum, lr {WHOLE_LR}. Plain PyTorch: one fresh process (`python -m "
                  f"benchmarks.bench_orchestration --plain {WHOLE_EPOCHS}`), batch "
                  f"{p['batch_size']} (the same global batch, {p['steps_per_epoch']} steps per epoch), "
                  f"SGD momentum 0.9, lr {WHOLE_LR}, a validation pass per epoch, {p['threads']} torch "
                  "threads.", "",
                  "| | seconds | / plain process |", "|---|---|---|",
                  f"| Zooid: submit `train/local` -> flow run seen final (0.1 s polls) | {submit_done:.2f} | "
                  f"{submit_done / p['wall_s']:.1f}x |",
                  f"| Zooid: flow run start -> end (Prefect's timestamps) | {fmt(flow)} | "
                  f"{fmt(None if flow is None else flow / p['wall_s'], '{:.1f}x')} |",
                  f"| Zooid: submit -> flow run start (queue, worker poll, process start) | "
                  f"{fmt(z['flow_start_at'] - z['submitted_at'] if z['flow_start_at'] else None)} | |",
                  f"| Zooid: sum of the {len(z['epochs'])} epochs' wall | {in_epochs:.2f} | |",
                  f"| Plain PyTorch: process spawn -> exit (imports included) | {p['wall_s']:.2f} | 1.0x |",
                  f"| Plain PyTorch: data + model setup in the process | {p['setup_s']:.2f} | |",
                  f"| Plain PyTorch: training loop (+ validation) | {p['loop_s']:.2f} | |",
                  "",
                  f"Final validation accuracy: Zooid {fmt(z.get('final_accuracy'), '{:.3f}')}, plain PyTorch "
                  f"{fmt(p['val_accuracy'], '{:.3f}')}."]
    return "\n".join(lines) + "\n"


def _row(r: dict) -> str:
    return (f"| {r['target']} | {r['mode']} | {r['workers']} | {r['epoch']} | {r['wall_s']:.2f} | "
            f"{r['busy_s']:.2f} | {r['overhead_s']:.2f} | {pct(r['share'])} | "
            f"{fmt(r['new_procs'], '{}')} | {fmt(r['val_accuracy'], '{:.3f}')} |")


def _print_rows(label: str, rows: list[dict]) -> None:
    print(f"{label}: " + ", ".join(f"e{r['epoch']} overhead {r['overhead_s']:.2f} s of {r['wall_s']:.2f} s"
                                   for r in rows), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the three parts against one stack and write the markdown."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_orchestration",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=DEFAULT_WORKERS)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--no-long", action="store_true", help="skip the long-epoch case")
    parser.add_argument("--long-samples", type=int, default=LONG_SAMPLES,
                        help="training rows of the long case's synthetic dataset")
    parser.add_argument("--long-batch", type=int, default=LONG_BATCH)
    parser.add_argument("--no-whole-run", action="store_true", help="skip the whole-run comparison")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (stores, logs)")
    parser.add_argument("--plain", type=int, metavar="EPOCHS", help=argparse.SUPPRESS)
    parser.add_argument("--plain-batch", type=int, default=WHOLE_WORKERS * WHOLE_BATCH, help=argparse.SUPPRESS)
    parser.add_argument("--plain-lr", type=float, default=WHOLE_LR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain is not None:  # the plain-PyTorch side of the whole-run comparison
        print(json.dumps(plain_pytorch(args.plain, args.plain_batch, args.plain_lr)))
        return 0

    prov = provenance()
    rows: list[dict] = []
    long_rows = long_info = whole = None
    with scratch("orch", keep=args.keep) as base, local_stack(base / "stack"):
        inline_home = base / "inline"
        inline_home.mkdir(parents=True)
        for w in args.workers:
            for mode in ("warm", "cold"):
                params = digits_job(w, args.epochs, warm=mode == "warm")
                for target in ("inline", "pool"):
                    summary = run_inline(params, inline_home) if target == "inline" else pool_summary(params)
                    got = epoch_rows(target, mode, summary)
                    rows += got
                    _print_rows(f"{target:6s} {mode} workers={w}", got)
        if not args.no_long:
            params = long_params(args.long_samples, args.long_batch)
            long_rows = epoch_rows("pool", "warm", pool_summary(params, timeout_s=1800))
            _print_rows("long   warm workers=2", long_rows)
            long_info = {"params_job": params, "stats": summarise_rows(long_rows),
                         "params": sum(p.numel() for p in long_mlp().parameters())}
        if not args.no_whole_run:
            zooid = pool_summary(digits_job(WHOLE_WORKERS, WHOLE_EPOCHS, warm=True), timeout_s=1800)
            plain = run_plain(WHOLE_EPOCHS, WHOLE_WORKERS * WHOLE_BATCH, WHOLE_LR)
            whole = {"zooid": zooid, "plain": plain}
            print(f"whole run: zooid {zooid['seen_final_at'] - zooid['submitted_at']:.2f} s, "
                  f"plain {plain['wall_s']:.2f} s", flush=True)
    command = ".venv/bin/python -m benchmarks.bench_orchestration"
    if args.workers != DEFAULT_WORKERS:
        command += f" --workers {' '.join(map(str, args.workers))}"
    if args.epochs != DEFAULT_EPOCHS:
        command += f" --epochs {args.epochs}"
    if args.no_long:
        command += " --no-long"
    else:
        command += f" --long-samples {args.long_samples}" if args.long_samples != LONG_SAMPLES else ""
        command += f" --long-batch {args.long_batch}" if args.long_batch != LONG_BATCH else ""
    if args.no_whole_run:
        command += " --no-whole-run"
    if args.out.resolve() != RESULTS:
        command += f" --out {args.out}"
    write_result(args.out, TITLE, command, prov, render(rows, long_rows, long_info, whole, args.epochs),
                 detail=DETAIL, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

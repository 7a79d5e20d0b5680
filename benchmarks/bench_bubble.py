"""Pipeline bubble: each stage's measured idle share next to the GPipe ideal (k-1)/(M+k-1).

The model is a chain of equal blocks (`uniform_mlp`: Linear(W, W) + ReLU, W = 1024, 8
blocks, then a classifier) cut into k equal stages, so the ideal's assumption of equal
stage times holds as well as hardware allows. Each run trains `--steps` iterations of a
256-row batch split into M micro-batches, every stage worker its own process (one torch
thread) running the real executor (`training.pipeline_executor`) against a directory
store in a temporary folder.

`WorkerResult` reports a stage's summed compute time, not when each action ran, so the
benchmark's worker processes wrap the executor (`bench_prediction.install_timers`): a
forward hook and a wrapper of `Tensor.backward` stamp every F and B, and the iteration,
every upload and every store read are stamped too. All stamps come from one monotonic
clock shared by the processes. For each iteration after the first two (warm-up):

- measured idle share of stage s = 1 - (s's F and B time) / span, with span from the first
  F of any stage to the last B of any stage in that iteration (the GPipe definition:
  transfers and waits inside the span count as idle, the optimizer step after it does not);
- idle share of the period = 1 - (s's F and B time) / (s's iteration period), which also
  charges the optimizer step, the upload drain and the next iteration's first wait.

Beside them, `training.pipeline_schedule.simulate` replays the lowered GPipe schedule
with the measured median durations: compute only (F and B per stage) and with transfers
(plus the median upload and the median read of an activation), so a gap between the ideal
and the measurement can be split into unequal stages, transfers, and the rest.

    .venv/bin/python -m benchmarks.bench_bubble [--steps 6] [--stages 2 4] [--microbatches 1 2 4 8]

Writes markdown with the command to `benchmarks/results/bubble.md`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench_prediction import REPO, WARMUP_ITERATIONS, run_workers
from benchmarks.output import write_result

RESULTS = REPO / "benchmarks" / "results" / "bubble.md"
MODEL = "benchmarks.bench_bubble:uniform_mlp"
WIDTH, BLOCKS, BATCH, LR, SEED = 1024, 8, 256, 0.01, 0
DATASET = f"synthetic:{WIDTH}:10:2048:64"


def uniform_mlp(width: int = WIDTH, blocks: int = BLOCKS, classes: int = 10):
    """`blocks` equal children Linear(width, width) + ReLU, then Linear(width, classes)."""
    from torch import nn

    chain = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]
    return nn.Sequential(*chain, nn.Linear(width, classes))


def equal_cuts(stages: int) -> list[int]:
    """Executor cuts (child index where a stage begins) giving each stage BLOCKS / stages
    blocks; the small classifier rides with the last stage."""
    if BLOCKS % stages:
        raise ValueError(f"stages: must divide {BLOCKS} blocks, got {stages}")
    return [i * BLOCKS // stages for i in range(1, stages)]


def gpipe_ideal(stages: int, microbatches: int) -> float:
    """(k-1)/(M+k-1)."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclass
class Bubble:
    """One (k, M) run: per stage measured and simulated idle shares."""

    stages: int
    microbatches: int
    measured: list[float]
    of_period: list[float]
    simulated_compute: list[float]
    simulated_transfers: list[float]
    forward_ms: list[float]
    backward_ms: list[float]
    put_ms: float
    read_ms: float
    span_ms: float
    period_ms: float
    load: tuple


def _within(stamps, window) -> list[tuple[float, float]]:
    lo, hi = window
    return [(a, b) for a, b in stamps if a >= lo and b <= hi]


def analyse(stages: int, microbatches: int, outs: list[dict], load: tuple) -> Bubble:
    """Idle shares from the stage workers' stamps, and the simulator fed their durations."""
    from training.pipeline_schedule import gpipe, lower, simulate

    by_stage = sorted(outs, key=lambda o: o["result"]["rank"])
    iterations = [o["timings"]["iterations"] for o in by_stage]
    n = min(len(it) for it in iterations)
    measured, of_period, spans, periods = [[] for _ in range(stages)], [[] for _ in range(stages)], [], []
    for i in range(WARMUP_ITERATIONS, n):
        compute = []
        for s, o in enumerate(by_stage):
            window = iterations[s][i]
            compute.append(sorted(_within(o["timings"]["F"] + o["timings"]["B"], window)))
        span = max(c[-1][1] for c in compute) - min(c[0][0] for c in compute)
        spans.append(span)
        for s, c in enumerate(compute):
            busy = sum(b - a for a, b in c)
            period = iterations[s][i][1] - iterations[s][i - 1][1]
            measured[s].append(1 - busy / span)
            of_period[s].append(1 - busy / period)
            periods.append(period)

    def median_ms(stamps) -> float:
        return statistics.median(b - a for a, b, *_ in stamps) if stamps else 0.0

    fwd = [median_ms(o["timings"]["F"]) for o in by_stage]
    bwd = [median_ms(o["timings"]["B"]) for o in by_stage]
    put = median_ms([p for o in by_stage for p in o["timings"]["put"]])
    read = median_ms([r for o in by_stage for r in o["timings"]["read"]])
    schedule = lower(gpipe(stages, microbatches), sync=True)
    compute_only = {**{f"{s}F": fwd[s] for s in range(stages)}, **{f"{s}B": bwd[s] for s in range(stages)}}
    with_transfers = {**compute_only, "SEND_F": put, "SEND_B": put, "RECV_F": read, "RECV_B": read}
    return Bubble(stages, microbatches,
                  [statistics.median(m) for m in measured], [statistics.median(m) for m in of_period],
                  simulate(schedule, compute_only).bubble, simulate(schedule, with_transfers).bubble,
                  [f * 1e3 for f in fwd], [b * 1e3 for b in bwd], put * 1e3, read * 1e3,
                  statistics.median(spans) * 1e3, statistics.median(periods) * 1e3, load)


def run_one(stages: int, microbatches: int, url: str, epoch: int, n_subsets: int, steps: int,
            scratch: Path) -> Bubble:
    """One pipeline of `stages` equal stages and `microbatches` micro-batches, measured."""
    from training.pipeline_executor import pipeline_worker_specs
    from training.specs import WorkerSpec

    base = WorkerSpec(run_id="bubble", epoch=epoch, rank=0, world=stages, store_url=url, model=MODEL,
                      dataset=DATASET, subsets=(), steps=steps, batch_size=BATCH, lr=LR,
                      optimizer="sgd", seed=SEED, init_key="runs/bubble/init",
                      out_key=f"runs/bubble/out-e{epoch}", sync_timeout_s=300.0, evaluate=False,
                      extra={"strategy": "pipeline"})
    specs = pipeline_worker_specs(base, cuts=equal_cuts(stages), microbatches=microbatches,
                                  replica_subsets=[tuple(range(n_subsets))])
    scratch.mkdir()
    before = os.getloadavg()[0]
    outs = run_workers(specs, scratch)
    return analyse(stages, microbatches, outs, (before, os.getloadavg()[0]))


def _pct(values) -> str:
    return " / ".join(f"{v:.0%}" for v in values)


def table(rows: list[Bubble]) -> list[str]:
    """Markdown: per (k, M) the ideal, the measured shares and the simulator's, per stage."""
    out = ["| k | M | GPipe ideal | measured idle share per stage | idle share of the period | "
           "simulated: measured F/B only | simulated: F/B + transfers | F ms per stage | "
           "B ms per stage | put / read ms | span / period ms | load avg |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r.stages} | {r.microbatches} | {gpipe_ideal(r.stages, r.microbatches):.0%} | "
            f"{_pct(r.measured)} | {_pct(r.of_period)} | {_pct(r.simulated_compute)} | "
            f"{_pct(r.simulated_transfers)} | {' / '.join(f'{v:.1f}' for v in r.forward_ms)} | "
            f"{' / '.join(f'{v:.1f}' for v in r.backward_ms)} | {r.put_ms:.1f} / {r.read_ms:.1f} | "
            f"{r.span_ms:.0f} / {r.period_ms:.0f} | {r.load[0]:.1f}-{r.load[1]:.1f} |")
    return out


def write_report(rows: list[Bubble], args, seconds: float, cores: int) -> None:
    """benchmarks/results/bubble.md with the command that produced it."""
    command = ("    .venv/bin/python -m benchmarks.bench_bubble --steps " + str(args.steps)
               + " --stages " + " ".join(map(str, args.stages))
               + " --microbatches " + " ".join(map(str, args.microbatches)))
    within = [r for r in rows if r.stages <= cores]
    beyond = [r for r in rows if r.stages > cores]
    md = ["# Pipeline bubble: measured idle share per stage vs the GPipe ideal", "",
          f"Command (run from the repository root; {seconds:.0f} s on {cores} cores, one torch "
          "thread per stage worker):", "", command, "",
          f"Model: `uniform_mlp` ({BLOCKS} blocks of Linear({WIDTH}, {WIDTH}) + ReLU, then a "
          f"classifier) cut into k equal stages; batch {BATCH} rows split into M micro-batches; "
          f"GPipe schedule (all forwards, then all backwards) lowered with sends, receives and "
          "sync; directory store in a temporary folder. Shares are medians over the iterations "
          f"after {WARMUP_ITERATIONS} warm-up ones; per-stage values are listed stage 0 first. "
          "Method and definitions: module docstring of `benchmarks/bench_bubble.py`. "
          "`load avg` is the machine's 1-minute load before and after the run (other people's "
          "jobs share these cores).", "",
          f"## Stage processes <= cores ({cores})", "", *table(within), "",
          f"## Stage processes > cores ({cores}): stages time-share the cores", "", *table(beyond), ""]
    write_result(RESULTS, "\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Measure every (k, M) pair and write the report."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_bubble", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="iterations per run (>= 4)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    if args.steps < WARMUP_ITERATIONS + 2:
        parser.error(f"--steps must be at least {WARMUP_ITERATIONS + 2}")
    for k in args.stages:
        if k < 2 or BLOCKS % k:
            parser.error(f"--stages: each must be >= 2 and divide {BLOCKS}, got {k}")
    if any(m < 1 or BATCH % m for m in args.microbatches):
        parser.error(f"--microbatches: each must be >= 1 and divide the batch of {BATCH}")

    from training.checkpoint import initial_checkpoint
    from training.datasets import publish_dataset
    from training.store import open_store

    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="zooid-bubble-"))
    rows = []
    try:
        url = (root / "store").as_uri()
        store = open_store(url)
        manifest = publish_dataset(store, "bubble", DATASET, subset_size=64)
        initial_checkpoint(store, "runs/bubble/init", MODEL, "sgd", LR, SEED)
        store.close()
        for k in args.stages:
            for m in args.microbatches:
                began = time.perf_counter()
                row = run_one(k, m, url, len(rows), manifest.n_subsets, args.steps, root / f"e{len(rows)}")
                rows.append(row)
                print(f"k={k} M={m}: ideal {gpipe_ideal(k, m):.0%}, measured {_pct(row.measured)}, "
                      f"simulated {_pct(row.simulated_transfers)} ({time.perf_counter() - began:.1f} s, "
                      f"load {row.load[0]:.1f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_report(rows, args, time.perf_counter() - t0, cores)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

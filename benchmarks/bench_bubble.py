"""Pipeline bubble and activation memory per schedule: GPipe, 1F1B and interleaved 1F1B.

The model is a chain of equal blocks (`uniform_mlp`: Linear(W, W) + ReLU, W = `--width`,
default 4096, 8 blocks, then a classifier) cut into equal stages, so the ideals' assumption
of equal stage times holds as well as hardware allows. Each run trains `--steps` iterations
of a `--batch`-row batch (default 128) split into M micro-batches, every stage worker its own
process (one torch thread) running the real executor (`engine.pipeline_executor`) against a
directory store in a temporary folder, with the schedule named in the worker specs'
`stage.schedule`. A block's compute grows with W squared and its activation with W, so a
wider model makes the store's fixed per-transfer costs (the hand-off's polling delay) a
smaller part of a chunk: the regime the interleaved schedule is for.

Runs: for every k in `--stages` and M in `--microbatches`, each schedule of `--schedules`
(`gpipe`, `1f1b`, `interleaved`; in that order for each (k, M), so a drift of the machine
touches all of them). `interleaved` has k stage workers and v = `--chunks` chunks per
worker: the model is cut into k * v stages (model stage s on worker s % k, the worker specs'
`chunks` = v) and it runs only for M a multiple of k. The executor runs it like the others;
should building its worker specs or running them raise, the row says "not runnable by the
executor" with the error, and the schedule is simulated only, with chunk durations taken
from the 1F1B run of the same k and M (model stage s of the k * v holds the blocks of 1F1B
stage s // v, so its F and B are that stage's divided by v; the transfers are the same size).

Timing. `WorkerResult` reports a stage's summed compute time, not when each action ran, so
the benchmark starts its own worker processes (`python -m benchmarks.bench_bubble --worker`,
through `benchmarks.harness.workers.run_workers`) which wrap the executor
(`benchmarks.harness.workers.install_timers`): a forward hook and a wrapper of `Tensor.backward` stamp
every F and B, and the iteration, every upload and every store read are stamped too. All
stamps come from one monotonic clock shared by the processes. For each iteration after the
first two (warm-up):

- measured idle share of stage worker w = 1 - (w's F and B time) / span, with span from the
  first F of any worker to the last B of any worker in that iteration (transfers and waits
  inside the span count as idle, the optimizer step after it does not);
- idle share of the period = 1 - (w's F and B time) / (w's iteration period), which also
  charges the optimizer step, the upload drain and the next iteration's first wait.

Beside them: the schedule's ideal (`ideal_bubble`: equal stage times, free transfers), and
`core.schedule_costs.simulate` replaying `lower(build_schedule(...))` with the
measured median durations: compute only (F and B per model stage; a worker's i-th F stamp
in an iteration is the i-th F of its row, which tells an interleaved worker's chunks apart)
and with transfers (plus the median upload and the median read of an activation, and the
median hand-off: from a put's end to the start of the read that found the key, over the
keys whose reader was already waiting, the directory store's polling delay, which `simulate`
charges to a receive whose download thread waits, as `planners.pipeline_time` does). And a
third replay, per iteration: each F and B action takes the duration it measured in that
iteration (the i-th F stamp of a worker is the i-th F of its row), transfers the medians,
and the shares are the median over iterations (`replay_shares`). The median replay assumes
every micro-batch of a stage takes the same time, as the planner does (`planners.pipeline_time`
prices each stage by one F and one B duration), so it is the one the measurement is judged
against; the per-iteration one replays the spread the machine really had (a slow micro-batch
on one stage idles the stages after it) and is shown beside it, not judged (it is fed the very
durations it is compared with). A run is "within 10 %" when on every stage worker
|measured - simulated| <= 10 % of that simulated idle share (relative, not percentage
points: a 2-point miss on an 11 % ideal is a 20 % longer wait than modelled).

Activation memory, measured inside each stage worker process (the same processes as the
timing; the hooks cost a Python call per saved tensor, microseconds against milliseconds of
F). On CPU, "tracked bytes held": around each training iteration the wrapper installs
`torch.autograd.graph.saved_tensors_hooks` whose pack hook wraps every tensor autograd
saves for a backward in a holder that adds its bytes to a process-wide counter, and takes
them off in `__del__` (when the backward frees the graph); unpack returns the tensor.
Counted: every saved tensor not backed by a parameter's storage (parameters and their
views, such as the transposed weight a Linear saves, are held whatever the schedule and are
left out): the stage's input micro-batch, each block's ReLU output (which the next Linear
also saves: one storage), the last stage's log-softmax and labels. Two counters: "distinct
storages" counts each storage once while any holder holds it (the bytes actually kept alive;
the goal uses this one), "summed over holders" adds numel * element_size per holder (a
storage saved twice counts twice). Not counted: what the executor keeps outside the graph,
its `inputs`/`outputs` dicts after a micro-batch's backward (stage 0 keeps every
micro-batch's input rows until the iteration ends, the batch's 1 MiB whatever the
schedule; a later stage keeps an input's gradient until its upload is done) and tensors in
the upload/download queues; between F and B those dicts hold the same storages the graph
saved. The peak is the counter's maximum over the iterations after warm-up. On CUDA also
`torch.cuda.max_memory_allocated` minus the allocation at the iteration's start (peak
statistics reset per iteration): everything the iteration allocated, temporaries and
gradients included, and the goal uses it there.

Goals, computed from the run and printed in the report: 1F1B's peak activation bytes on
stage 0 <= 55 % of GPipe's at k = 4, M = 8; interleaved (v = 2) idle share (mean over stage
workers) <= 60 % of 1F1B's at k = 4, M = 8, measured where k <= cores, otherwise from the
simulation with transfers (stage processes that time-share the cores measure the
oversubscription, not the schedule); measured within 10 % of the simulation.

    .venv/bin/python -m benchmarks.bench_bubble [--steps 6] [--schedules gpipe 1f1b interleaved]
        [--stages 2 4] [--microbatches 1 2 4 8] [--chunks 2] [--out benchmarks/results/bubble.md]

Writes markdown with the command to `benchmarks/results/bubble.md` (or `--out`).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.home import REPO, scratch
from benchmarks.harness.tables import median
from benchmarks.harness.workers import WARMUP_ITERATIONS, run_workers, worker_main as timed_worker_main
from benchmarks.output import Provenance, provenance, write_result
from core.keys import checkpoint_key, init_checkpoint_key

RESULTS = REPO / "benchmarks" / "results" / "bubble.md"
SOURCES = ("core", "comm", "engine", "runtime/run_spec.py", "runtime/store_report.py", "requirements.lock",
           "benchmarks/harness/workers.py", "benchmarks/harness/tables.py")
"""The code it measures (the pipeline executor in instrumented worker processes): its results file is stale
once one of these changed since the commit the file names (`benchmarks.staleness`)."""
MODEL = "benchmarks.bench_bubble:uniform_mlp"
WIDTH, BLOCKS, BATCH, LR, SEED = 4096, 8, 128, 0.01, 0
"""Defaults; `--width` and `--batch` change the block width and the batch."""


def dataset_name(width: int, batch: int, steps: int) -> str:
    """Synthetic rows of `width` features, 10 classes: an epoch of `steps` batches of `batch`
    rows (a pipeline's steps are its epoch's, `engine.epoch_order.epoch_steps`)."""
    return f"synthetic:{width}:10:{steps * batch}:64"
SCHEDULES = ("gpipe", "1f1b", "interleaved")
TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved 1F1B"}
TOLERANCE = 0.10  # measured vs simulated idle share, relative to the simulated one
GOAL_K, GOAL_M = 4, 8
GOAL_MEMORY = 0.55  # 1F1B stage-0 peak activation bytes / GPipe's
GOAL_BUBBLE = 0.60  # interleaved idle share / 1F1B's
MIB = 2 ** 20


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


# --- the worker process: the executor with timers and an activation-memory counter --------


class _Held:
    """Process-wide bytes of the tensors autograd holds for backwards (see the docstring)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.storages: dict[tuple, list[int]] = {}  # storage key -> [holders, storage bytes]
        self.distinct = self.summed = 0
        self.peak_distinct = self.peak_summed = 0
        self.params: set[tuple] = set()

    def add(self, key: tuple, storage_bytes: int, nbytes: int) -> None:
        with self.lock:
            self.summed += nbytes
            entry = self.storages.get(key)
            if entry is None:
                self.storages[key] = [1, storage_bytes]
                self.distinct += storage_bytes
            else:
                entry[0] += 1
            self.peak_distinct = max(self.peak_distinct, self.distinct)
            self.peak_summed = max(self.peak_summed, self.summed)

    def remove(self, key: tuple, nbytes: int) -> None:
        with self.lock:
            self.summed -= nbytes
            entry = self.storages[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self.storages[key]
                self.distinct -= entry[1]

    def reset_peak(self) -> None:
        with self.lock:
            self.peak_distinct, self.peak_summed = self.distinct, self.summed


class _Saved:
    """One saved tensor, counted while autograd holds it."""

    __slots__ = ("tensor", "key", "nbytes", "held")

    def __init__(self, tensor, key: tuple, held: _Held):
        self.tensor, self.key, self.held = tensor, key, held
        self.nbytes = tensor.numel() * tensor.element_size()
        held.add(key, tensor.untyped_storage().nbytes(), self.nbytes)

    def __del__(self):
        self.held.remove(self.key, self.nbytes)


def _storage_key(tensor) -> tuple:
    return (tensor.device.type, tensor.device.index, tensor.untyped_storage().data_ptr())


def _parameter_keys(worker) -> set[tuple]:
    """Storage keys of every parameter the stage worker holds: its modules' (one, or a list
    or dict of chunks) and its optimizers'."""
    import torch

    found = []
    for value in vars(worker).values():
        for item in (value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple))
                     else [value]):
            if isinstance(item, torch.nn.Module):
                found += list(item.parameters())
            elif isinstance(item, torch.optim.Optimizer):
                found += [p for g in item.param_groups for p in g["params"]]
    return {_storage_key(p) for p in found}


def install_memory_tracker(mem: dict) -> None:
    """Wrap the stage worker's training iteration: count the bytes autograd saves (pack and
    unpack hooks on this thread, parameters left out) and append per iteration the peak of
    `saved_distinct` and `saved_summed`, what is still held at its end (`left`, 0 when every
    graph was freed), and on CUDA `cuda` = max_memory_allocated - allocated at its start."""
    import torch

    from engine import pipeline_stage_worker

    held = _Held()
    for name in ("saved_distinct", "saved_summed", "left", "cuda"):
        mem.setdefault(name, [])

    def pack(tensor):
        key = _storage_key(tensor)
        return tensor if key in held.params else _Saved(tensor, key, held)

    def unpack(packed):
        return packed if isinstance(packed, torch.Tensor) else packed.tensor

    worker = pipeline_stage_worker.StageWorker
    iteration = worker._iteration

    def tracked_iteration(self, *args, **kwargs):
        held.params = _parameter_keys(self)
        device = getattr(self, "device", None)
        cuda = device is not None and device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        held.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            result = iteration(self, *args, **kwargs)
        mem["saved_distinct"].append(held.peak_distinct)
        mem["saved_summed"].append(held.peak_summed)
        mem["left"].append(held.distinct)
        if cuda:
            torch.cuda.synchronize(device)
            mem["cuda"].append(torch.cuda.max_memory_allocated(device) - base)
        return result

    worker._iteration = tracked_iteration


def worker_main(spec_path: str, out_path: str) -> None:
    """Run one stage worker's WorkerSpec with timers and the memory counter; write JSON."""
    timed_worker_main(spec_path, out_path, probes={"memory": install_memory_tracker})


# --- analysis -----------------------------------------------------------------------------


@dataclass
class Row:
    """One (schedule, k, M) run: per stage worker measured and simulated idle shares, and
    peak activation bytes; `measured` is None when the schedule was only simulated."""

    schedule: str
    stages: int
    """k, stage workers (p for interleaved)."""
    microbatches: int
    chunks: int
    ideal: float
    measured: list[float] | None
    of_period: list[float] | None
    simulated_compute: list[float]
    simulated_transfers: list[float]
    forward_ms: list[float]
    """Median F per model stage (k * v of them for interleaved)."""
    backward_ms: list[float]
    put_ms: float
    read_ms: float
    span_ms: float | None
    period_ms: float | None
    load: tuple | None
    seconds: float
    memory: list[dict] | None
    """Per stage worker: peak `distinct`, `summed` (bytes), `cuda` (bytes or None), `left`;
    or `estimated` (bytes) for a simulated-only row."""
    source: str = "measured"
    error: str = ""
    simulated_fitting: list[float] | None = None
    """For k > cores: the simulation with transfers fed the durations of the 1F1B run with the
    most stage workers that fit the cores (same M), split per block (`split_durations`)."""
    fitting_stages: int = 0
    """That run's k."""
    handoff_ms: float = 0.0
    """Median delay from a put's end to the read that found the key, where the reader waited."""
    simulated_replay: list[float] | None = None
    """Per stage worker, the median over iterations of the simulation with transfers fed that
    iteration's own F and B durations, action by action (`replay_shares`)."""

    @property
    def compared(self) -> list[float]:
        """The simulation the measurement is judged against: the replay of the median durations
        with transfers (the planner's view), not the per-iteration replay."""
        return self.simulated_transfers

    @property
    def within(self) -> bool | None:
        """Every stage worker's measured idle share within TOLERANCE of the simulation."""
        if self.measured is None:
            return None
        return all(abs(m - s) <= TOLERANCE * s for m, s in zip(self.measured, self.compared))

    def peak_bytes(self, worker: int) -> float | None:
        """The goal's figure: CUDA's peak where measured on a GPU, else distinct storages."""
        if not self.memory:
            return None
        m = self.memory[worker]
        if "estimated" in m:
            return m["estimated"]
        return m["cuda"] if m.get("cuda") is not None else m["distinct"]


def _within(stamps, window) -> list[tuple[float, float]]:
    lo, hi = window
    return [(a, b) for a, b, *_ in stamps if a >= lo and b <= hi]


def _mean(values) -> float:
    return sum(values) / len(values)


def simulate_shares(name: str, stages: int, microbatches: int, chunks: int, fwd, bwd, put: float,
                    read: float, handoff: float = 0.0) -> tuple[list[float], list[float]]:
    """Idle share per stage worker of the lowered schedule replayed with these durations:
    compute only, and with transfers (and `handoff` paid by a receive that waits)."""
    from core.schedule_costs import simulate
    from core.schedules import build_schedule, lower

    schedule = lower(build_schedule(name, stages, microbatches, chunks), sync=True)
    compute_only = {**{f"{s}F": f for s, f in enumerate(fwd)}, **{f"{s}B": b for s, b in enumerate(bwd)}}
    with_transfers = {**compute_only, "SEND_F": put, "SEND_B": put, "RECV_F": read, "RECV_B": read}
    return (simulate(schedule, compute_only).bubble,
            simulate(schedule, with_transfers, handoff_s=handoff).bubble)


def replay_shares(name: str, stages: int, microbatches: int, chunks: int, actual: dict, fwd, bwd,
                  put: float, read: float, handoff: float) -> list[float]:
    """Idle share per stage worker of one iteration replayed with its own durations: each F
    and B action takes what that action measured in the iteration (`actual`: (model stage,
    kind, micro-batch) -> seconds; the stage's median where one is missing), transfers the
    medians, as in `simulate_shares`."""
    from core.schedule_costs import simulate
    from core.schedules import Kind, build_schedule, lower

    schedule = lower(build_schedule(name, stages, microbatches, chunks), sync=True)
    median = {Kind.F: fwd, Kind.B: bwd}
    transfers = {Kind.SEND_F: put, Kind.SEND_B: put, Kind.RECV_F: read, Kind.RECV_B: read}

    def duration(action) -> float:
        if action.kind in median:
            return actual.get((action.stage, action.kind, action.microbatch), median[action.kind][action.stage])
        return transfers.get(action.kind, 0.0)

    return simulate(schedule, duration, handoff_s=handoff).bubble


def _peak_after_warmup(values: list) -> float | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return max(values[WARMUP_ITERATIONS:] or values)


def analyse(name: str, stages: int, microbatches: int, chunks: int, outs: list[dict], load: tuple,
            seconds: float) -> Row:
    """Idle shares from the stage workers' stamps, the simulator fed their durations, and
    the workers' peak activation bytes."""
    from core.schedule_costs import ideal_bubble
    from core.schedules import Kind, build_schedule

    rows = build_schedule(name, stages, microbatches, chunks)
    by_worker = sorted(outs, key=lambda o: o["result"]["rank"])
    iterations = [o["timings"]["iterations"] for o in by_worker]
    n = min(len(it) for it in iterations)
    measured, of_period = [[] for _ in by_worker], [[] for _ in by_worker]
    spans, periods = [], []
    per_stage = {Kind.F: [[] for _ in range(stages * chunks)], Kind.B: [[] for _ in range(stages * chunks)]}
    actual = []  # per iteration: (model stage, kind, micro-batch) -> seconds
    for i in range(WARMUP_ITERATIONS, n):
        compute, actual_i = [], {}
        actual.append(actual_i)
        for w, o in enumerate(by_worker):
            window = iterations[w][i]
            for kind in (Kind.F, Kind.B):
                stamps = sorted(_within(o["timings"][kind.value], window))
                owners = [a for a in rows[w] if a.kind is kind]
                if len(stamps) == len(owners):  # the i-th stamp is the row's i-th F (B)
                    for (a, b), action in zip(stamps, owners):
                        per_stage[kind][action.stage].append(b - a)
                        actual_i[(action.stage, kind, action.microbatch)] = b - a
                else:  # cannot tell chunks apart: each of the worker's stages gets them all
                    for s in {a.stage for a in owners}:
                        per_stage[kind][s] += [b - a for a, b in stamps]
            compute.append(sorted(_within(o["timings"]["F"] + o["timings"]["B"], window)))
        span = max(c[-1][1] for c in compute) - min(c[0][0] for c in compute)
        spans.append(span)
        for w, c in enumerate(compute):
            busy = sum(b - a for a, b in c)
            period = iterations[w][i][1] - iterations[w][i - 1][1]
            measured[w].append(1 - busy / span)
            of_period[w].append(1 - busy / period)
            periods.append(period)

    fwd = [median(d, 0.0) for d in per_stage[Kind.F]]
    bwd = [median(d, 0.0) for d in per_stage[Kind.B]]
    put = median((p[1] - p[0] for o in by_worker for p in o["timings"]["put"]), 0.0)
    read = median((r[1] - r[0] for o in by_worker for r in o["timings"]["read"]), 0.0)
    handoff = median(handoffs(by_worker), 0.0)
    compute_only, with_transfers = simulate_shares(name, stages, microbatches, chunks, fwd, bwd, put, read,
                                                   handoff)
    replays = [replay_shares(name, stages, microbatches, chunks, a, fwd, bwd, put, read, handoff) for a in actual]
    replay = [median(r[w] for r in replays) for w in range(stages)] if replays else None
    memory = [{"distinct": _peak_after_warmup(o["memory"]["saved_distinct"]),
               "summed": _peak_after_warmup(o["memory"]["saved_summed"]),
               "cuda": _peak_after_warmup(o["memory"]["cuda"]),
               "left": max(o["memory"]["left"] or [0])} for o in by_worker]
    return Row(name, stages, microbatches, chunks, ideal_bubble(name, stages, microbatches, chunks),
               [median(m) for m in measured], [median(m) for m in of_period],
               compute_only, with_transfers, [f * 1e3 for f in fwd], [b * 1e3 for b in bwd],
               put * 1e3, read * 1e3, median(spans) * 1e3, median(periods) * 1e3,
               load, seconds, memory, handoff_ms=handoff * 1e3, simulated_replay=replay)


def handoffs(outs: list[dict]) -> list[float]:
    """Per activation or gradient key whose reader's fetch began before the writer's put
    ended (the reader waited): seconds from the put's end to the start of the read that
    found the key. Keys are unique within a run and the stamps share one clock."""
    put_end = {p[3]: p[1] for o in outs for p in o["timings"]["put"]}
    fetch_start = {f[2]: f[0] for o in outs for f in o["timings"]["fetch"]}
    return [max(0.0, r[0] - put_end[r[3]]) for o in outs for r in o["timings"]["read"]
            if r[3] in put_end and r[3] in fetch_start and fetch_start[r[3]] < put_end[r[3]]]


def split_durations(source: Row, model_stages: int) -> tuple[list[float], list[float]] | None:
    """F and B ms of each of `model_stages` equal stages from `source`'s run of the same model
    with fewer (k') stages of the same micro-batch: model stage j holds blocks of k'-stage
    j // (n / k'), so it takes that stage's times divided by n / k' (None when k' does not
    divide n)."""
    have = len(source.forward_ms)
    if source.chunks != 1 or model_stages % have:
        return None
    factor = model_stages // have
    return ([source.forward_ms[j // factor] / factor for j in range(model_stages)],
            [source.backward_ms[j // factor] / factor for j in range(model_stages)])


def simulated_only(name: str, stages: int, microbatches: int, chunks: int, source: Row | None,
                   error: str) -> Row:
    """A schedule the executor did not run: the simulator fed the durations of `source` (the
    1F1B run of the same k and M), model stage s taking stage s // v's F and B divided by v;
    peak bytes estimated as the schedule's ideal in-flight chunk sets times `source`'s bytes
    per in-flight stage set (mean over its stages) divided by v."""
    from core.schedule_costs import ideal_bubble, ideal_peak_in_flight

    ideal = ideal_bubble(name, stages, microbatches, chunks)
    if source is None:
        return Row(name, stages, microbatches, chunks, ideal, None, None, [], [], [], [], 0.0, 0.0,
                   None, None, None, 0.0, None, "not simulated: no 1F1B or GPipe run of this k and M", error)
    fwd, bwd = split_durations(source, stages * chunks)
    compute_only, with_transfers = simulate_shares(name, stages, microbatches, chunks, fwd, bwd,
                                                   source.put_ms, source.read_ms, source.handoff_ms)
    memory = None
    if source.memory:
        per_set = _mean([source.peak_bytes(w) / ideal_peak_in_flight(source.schedule, stages, microbatches, w)
                         for w in range(stages)])
        memory = [{"estimated": ideal_peak_in_flight(name, stages, microbatches, w, chunks) * per_set / chunks}
                  for w in range(stages)]
    return Row(name, stages, microbatches, chunks, ideal, None, None, compute_only, with_transfers, fwd, bwd,
               source.put_ms, source.read_ms, None, None, None, 0.0, memory,
               f"simulated from the {TITLES[source.schedule]} run's durations", error,
               handoff_ms=source.handoff_ms)


# --- running -------------------------------------------------------------------------------


def run_one(name: str, stages: int, microbatches: int, chunks: int, url: str, epoch: int, n_subsets: int,
            steps: int, folder: Path, width: int = WIDTH, batch: int = BATCH) -> Row:
    """One pipeline of `stages` stage workers running schedule `name`, measured."""
    from core.specs import ComputeSpec, WorkerSpec
    from engine.pipeline_executor import pipeline_worker_specs

    base = WorkerSpec(run_id="bubble", epoch=epoch, rank=0, world=stages, store_url=url, model=MODEL,
                      dataset=dataset_name(width, batch, steps), steps=steps, batch_size=batch, lr=LR,
                      compute=ComputeSpec(model_kwargs={"width": width}),
                      optimizer="sgd", seed=SEED, init_key=init_checkpoint_key("bubble"),
                      out_key=checkpoint_key("bubble", epoch), sync_timeout_s=300.0, evaluate=False)
    specs = pipeline_worker_specs(base, cuts=equal_cuts(stages * chunks), microbatches=microbatches,
                                  replicas=1, schedule=name, chunks=chunks)
    if len(specs) != stages:
        raise RuntimeError(f"pipeline_worker_specs gave {len(specs)} worker specs for {stages} stage workers")
    folder.mkdir()
    before, began = os.getloadavg()[0], time.perf_counter()
    outs = run_workers(specs, folder, module="benchmarks.bench_bubble")
    return analyse(name, stages, microbatches, chunks, outs, (before, os.getloadavg()[0]),
                   time.perf_counter() - began)


def _last_line(exc: BaseException) -> str:
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    return (f"{type(exc).__name__}: " + (lines[-1] if lines else "")).replace("|", "/")


# --- the report --------------------------------------------------------------------------


def _pct(values) -> str:
    return " / ".join(f"{v:.0%}" for v in values) if values else "-"


def _ms(values) -> str:
    return " / ".join(f"{v:.1f}" for v in values) if values else "-"


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def table(rows: list[Row]) -> list[str]:
    """Markdown: per (k, M) the ideal, the measured shares and the simulator's, per stage worker."""
    if not rows:
        return ["_no runs_"]
    fitting = sorted({r.fitting_stages for r in rows if r.simulated_fitting})
    extra = (f"simulated: F/B of the k = {'/'.join(map(str, fitting))} run split per block + transfers | "
             if fitting else "")
    out = ["| k | M | ideal | measured idle share per stage | idle share of the period | "
           "simulated: measured F/B only | simulated: F/B + transfers | simulated: each iteration's own F/B + "
           f"transfers | measured / (F/B + transfers) - 1 | within 10 % | {extra}F ms per model stage | B ms per model stage | put / read / hand-off ms | span / period ms | "
           "load avg | source |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if fitting else "")]
    for r in rows:
        deviation = (" / ".join(f"{m / s - 1:+.0%}" if s else "-" for m, s in zip(r.measured, r.compared))
                     if r.measured else "-")
        within = "-" if r.within is None else ("yes" if r.within else "no")
        span = "-" if r.span_ms is None else f"{r.span_ms:.0f} / {r.period_ms:.0f}"
        load = "-" if r.load is None else f"{r.load[0]:.1f}-{r.load[1]:.1f}"
        out.append(
            f"| {r.stages} | {r.microbatches} | {r.ideal:.0%} | {_pct(r.measured)} | {_pct(r.of_period)} | "
            f"{_pct(r.simulated_compute)} | {_pct(r.simulated_transfers)} | {_pct(r.simulated_replay)} | "
            f"{deviation} | {within} | "
            + (f"{_pct(r.simulated_fitting)} | " if fitting else "")
            + f"{_ms(r.forward_ms)} | {_ms(r.backward_ms)} | {r.put_ms:.1f} / {r.read_ms:.1f} / {r.handoff_ms:.1f} | "
            f"{span} | "
            f"{load} | {r.source} |")
    return out


def memory_table(rows: list[Row]) -> list[str]:
    """Markdown: per run the ideal in-flight sets and the measured peak bytes per stage worker."""
    from core.schedule_costs import ideal_peak_in_flight

    cuda = any(m.get("cuda") is not None for r in rows for m in r.memory or [])
    out = ["| schedule | k | M | ideal in-flight sets per stage | peak activation MiB per stage "
           "(distinct storages) | summed over holders MiB | MiB per in-flight set | "
           + ("CUDA peak MiB | " if cuda else "") + "left at iteration end MiB | source |",
           "|---|---|---|---|---|---|---|" + ("---|" if cuda else "") + "---|---|"]
    for r in rows:
        sets = [ideal_peak_in_flight(r.schedule, r.stages, r.microbatches, w, r.chunks) for w in range(r.stages)]
        unit = "chunk" if r.chunks > 1 else "stage"
        mem = r.memory or []
        estimated = bool(mem) and "estimated" in mem[0]
        peaks = [r.peak_bytes(w) for w in range(r.stages)] if mem else []
        distinct = " / ".join(_mib(m.get("estimated", m.get("distinct"))) for m in mem) or "-"
        if estimated:
            distinct = "estimated " + distinct
        summed = " / ".join(_mib(m.get("summed")) for m in mem) if mem and not estimated else "-"
        per_set = " / ".join(f"{p / s / MIB:.3f}" for p, s in zip(peaks, sets)) if peaks else "-"
        left = " / ".join(_mib(m.get("left")) for m in mem) if mem and not estimated else "-"
        cells = [TITLES[r.schedule] + (f" (v = {r.chunks})" if r.chunks > 1 else ""), str(r.stages),
                 str(r.microbatches), " / ".join(map(str, sets)) + f" ({unit} sets)", distinct, summed, per_set]
        if cuda:
            cells.append(" / ".join(_mib(m.get("cuda")) for m in mem) if mem and not estimated else "-")
        cells += [left, r.source]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _points(r: Row) -> bool:
    """Every stage's measured idle share within TOLERANCE (as percentage points) of the simulation."""
    return all(abs(m - s) <= TOLERANCE for m, s in zip(r.measured, r.compared))


def _find(rows: list[Row], name: str, k: int, m: int) -> Row | None:
    return next((r for r in rows if r.schedule == name and r.stages == k and r.microbatches == m), None)


def add_fitting_simulations(rows: list[Row], cores: int) -> None:
    """For each row with more stage workers than cores, `simulated_fitting`: the simulation
    with transfers fed the durations of the measured 1F1B (else GPipe) run of the same M
    with the most stage workers that fit the cores, split per block. Stage processes that
    time-share the cores measure stretched, unequal F and B; these are free of that."""
    for r in rows:
        if r.stages <= cores:
            continue
        fitting = sorted((s for s in rows if s.measured is not None and s.chunks == 1 and s.stages <= cores
                          and s.microbatches == r.microbatches and (r.stages * r.chunks) % s.stages == 0),
                         key=lambda s: (s.stages, s.schedule == "1f1b"))
        if not fitting:
            continue
        source = fitting[-1]
        fwd, bwd = split_durations(source, r.stages * r.chunks)
        _, r.simulated_fitting = simulate_shares(r.schedule, r.stages, r.microbatches, r.chunks, fwd, bwd,
                                                 source.put_ms, source.read_ms, source.handoff_ms)
        r.fitting_stages = source.stages


def goals(rows: list[Row], args, cores: int) -> list[str]:
    """The three goals, computed from the rows; at k = 4, M = 8 when the run has them, and the
    same comparisons at each other k of the run (largest M) for information."""
    points = []
    for k in args.stages:
        m = GOAL_M if GOAL_M in args.microbatches else max(args.microbatches)
        points.append((k, m))
    if (GOAL_K, GOAL_M) not in points:
        lines = [f"- The goals are stated at k = {GOAL_K}, M = {GOAL_M}, which this run did not measure "
                 "(see `--stages` / `--microbatches`); the lines below make the same comparisons at the "
                 "configurations it ran, for information."]
    else:
        lines = []

    def verdict(ok: bool, k: int, m: int) -> str:
        if (k, m) == (GOAL_K, GOAL_M):
            return "**met**" if ok else "**not met**"
        return "for information: " + ("would be met" if ok else "would not be met")

    for k, m in points:
        g, f = _find(rows, "gpipe", k, m), _find(rows, "1f1b", k, m)
        if g and f and g.memory and f.memory:
            ratio = f.peak_bytes(0) / g.peak_bytes(0)
            what = "CUDA max_memory_allocated" if g.memory[0].get("cuda") is not None else "tracked saved-tensor bytes"
            lines.append(f"- Memory, k = {k}, M = {m}: 1F1B's peak activation bytes on stage 0 are "
                         f"{_mib(f.peak_bytes(0))} MiB against GPipe's {_mib(g.peak_bytes(0))} MiB = {ratio:.0%} "
                         f"(goal <= {GOAL_MEMORY:.0%}; measured in the stage processes, {what}): "
                         f"{verdict(ratio <= GOAL_MEMORY, k, m)}.")
        else:
            lines.append(f"- Memory, k = {k}, M = {m}: GPipe and 1F1B were not both measured.")
    for k, m in points:
        m_int = m if m % k == 0 else max([x for x in args.microbatches if x % k == 0] or [m])
        f, i = _find(rows, "1f1b", k, m_int), _find(rows, "interleaved", k, m_int)
        if not (f and i and i.simulated_transfers):
            lines.append(f"- Bubble, k = {k}, M = {m_int}: 1F1B and interleaved were not both run or simulated.")
            continue
        lines.append(bubble_goal(f, i, k, m_int, cores, verdict))
    fit = [r for r in rows if r.measured is not None and r.stages <= cores]
    over = [r for r in rows if r.measured is not None and r.stages > cores]
    ok = [r for r in fit if r.within]
    misses = ", ".join(f"{TITLES[r.schedule]} k = {r.stages} M = {r.microbatches}" for r in fit if not r.within)
    lines.append(f"- Measured within {TOLERANCE:.0%} of the simulation (every stage's measured idle share within "
                 f"{TOLERANCE:.0%} of the median replay with transfers, relative): {len(ok)} of {len(fit)} runs "
                 f"with stage processes <= {cores} cores"
                 + (f" (not: {misses})" if misses else "")
                 + f"; {sum(bool(r.within) for r in over)} of {len(over)} with more processes than cores, "
                 "which time-share the cores and are not expected to match: "
                 + ("**met**" if fit and len(ok) == len(fit) else "**not met**" if fit else "no runs within the cores")
                 + f". Within {TOLERANCE * 100:.0f} percentage points instead: {len([r for r in fit if _points(r)])} "
                 f"of {len(fit)} and {len([r for r in over if _points(r)])} of {len(over)}.")
    return lines


def bubble_goal(f: Row, i: Row, k: int, m: int, cores: int, verdict) -> str:
    """The interleaved-vs-1F1B bubble line: judged only from the measured idle shares; the
    simulated ratios are given beside it, labelled as simulated."""
    def ratio(a: float, b: float) -> float:
        return a / b if b else float("inf")

    own = _mean(i.simulated_transfers), _mean(f.simulated_transfers)
    simulated = [f"simulated with transfers, fed this k's own measured durations: {own[0]:.1%} / {own[1]:.1%} = "
                 f"{ratio(*own):.0%}"]
    if k > cores and i.simulated_fitting and f.simulated_fitting and i.fitting_stages == f.fitting_stages:
        fit = _mean(i.simulated_fitting), _mean(f.simulated_fitting)
        simulated.insert(0, f"simulated with transfers, fed the F and B of the k = {f.fitting_stages} 1F1B run of "
                            f"the same M split per block: {fit[0]:.1%} / {fit[1]:.1%} = {ratio(*fit):.0%}")
    head = f"- Bubble, k = {k}, M = {m}: interleaved (v = {i.chunks}) against 1F1B, idle share (mean over stage workers)"
    tail = f"; ideals {i.ideal:.1%} and {f.ideal:.1%}"
    if f.measured and i.measured:
        a, b = _mean(i.measured), _mean(f.measured)
        shared = (f"; k = {k} > {cores} cores, so the stage processes time-share the cores" if k > cores else "")
        return (f"{head}: measured {a:.1%} against {b:.1%} = {ratio(a, b):.0%} (goal <= {GOAL_BUBBLE:.0%}{shared}): "
                f"{verdict(ratio(a, b) <= GOAL_BUBBLE, k, m)}. Beside it, not measurements: "
                + "; ".join(simulated) + tail + ".")
    missing = "interleaved not runnable by the executor" if not i.measured else "1F1B not measured"
    return (f"{head}: not measured ({missing}), so not judged (goal <= {GOAL_BUBBLE:.0%}). Simulated only: "
            + "; ".join(simulated) + tail + ".")


def command_line(args) -> str:
    command = (".venv/bin/python -m benchmarks.bench_bubble --steps " + str(args.steps)
               + " --schedules " + " ".join(args.schedules)
               + " --stages " + " ".join(map(str, args.stages))
               + " --microbatches " + " ".join(map(str, args.microbatches))
               + " --chunks " + str(args.chunks)
               + (f" --width {args.width}" if args.width != WIDTH else "")
               + (f" --batch {args.batch}" if args.batch != BATCH else ""))
    return command + (f" --out {args.out}" if args.out else "")


def write_report(rows: list[Row], skipped: list[str], args, prov: Provenance, cores: int, out: Path) -> None:
    """The markdown report under the shared header (command, machine, code)."""
    md = [f"Model: `uniform_mlp` ({BLOCKS} blocks of Linear({args.width}, {args.width}) + ReLU, then a "
          f"classifier) cut into k equal stages (k * v for interleaved, model stage s on worker s % k); "
          f"batch {args.batch} rows split into M micro-batches; each schedule lowered with sends, receives "
          "and sync and run by the executor; directory store in a temporary folder. Shares are "
          f"medians over the iterations after {WARMUP_ITERATIONS} warm-up ones, peaks the maximum over "
          "them; per-stage values are listed stage worker 0 first. Method, definitions and what the "
          "memory counter counts: module docstring of `benchmarks/bench_bubble.py`. `load avg` is the "
          "machine's 1-minute load before and after the run (other people's jobs share these cores).", "",
          "## Goals", "", *goals(rows, args, cores), ""]
    for name in [s for s in SCHEDULES if s in args.schedules]:
        mine = [r for r in rows if r.schedule == name]
        title = TITLES[name] + (f" (v = {args.chunks})" if name == "interleaved" else "")
        md += [f"## {title}", ""]
        if name == "interleaved":
            errors = sorted({r.error for r in mine if r.error})
            ran = [r for r in mine if r.measured is not None]
            if errors:
                md += [f"Not runnable by the executor in {len(mine) - len(ran)} of {len(mine)} runs "
                       f"(simulation only there): " + "; ".join(f"`{e}`" for e in errors), ""]
            elif mine:
                md += ["Run by the executor.", ""]
        md += [f"### Stage processes <= cores ({cores})", "", *table([r for r in mine if r.stages <= cores]), "",
               f"### Stage processes > cores ({cores}): stages time-share the cores", "",
               *table([r for r in mine if r.stages > cores]), ""]
    md += ["## Peak activation memory per stage worker", "",
           "Ideal in-flight sets: `ideal_peak_in_flight` (micro-batches whose activations a stage holds at "
           "once; for interleaved, chunk sets of a worker, a chunk being 1/v of a stage). Peak: the "
           "counter of saved tensors (module docstring) in each stage process, maximum over the "
           "iterations after warm-up.", "",
           *memory_table(sorted(rows, key=lambda r: (r.stages, r.microbatches, SCHEDULES.index(r.schedule)))), ""]
    if skipped:
        md += ["Not run: " + "; ".join(skipped) + ".", ""]
    write_result(out, "Pipeline bubble and activation memory per schedule: GPipe, 1F1B, interleaved",
                 command_line(args), prov, "\n".join(md), detail="one torch thread per stage worker")


def main(argv: list[str] | None = None) -> int:
    """Measure every (schedule, k, M) and write the report (or, with --worker, run one
    instrumented stage worker)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_bubble", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="iterations per run (>= 4)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--chunks", type=int, default=2, help="v, chunks per worker for interleaved (>= 2)")
    parser.add_argument("--width", type=int, default=WIDTH, help="features of each Linear(W, W) block")
    parser.add_argument("--batch", type=int, default=BATCH, help="rows per iteration, split into M micro-batches")
    parser.add_argument("--out", help=f"where the markdown goes (default {RESULTS.relative_to(REPO)}); "
                                      "with --worker, the worker's JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.out)
        return 0
    if args.steps < WARMUP_ITERATIONS + 2:
        parser.error(f"--steps must be at least {WARMUP_ITERATIONS + 2}")
    for k in args.stages:
        if k < 2 or BLOCKS % k:
            parser.error(f"--stages: each must be >= 2 and divide {BLOCKS}, got {k}")
    if args.width < 1:
        parser.error("--width must be at least 1")
    if args.batch < 1 or any(m < 1 or args.batch % m for m in args.microbatches):
        parser.error(f"--microbatches: each must be >= 1 and divide the batch of {args.batch}")
    if args.chunks < 2:
        parser.error("--chunks must be at least 2")
    out = Path(args.out) if args.out else RESULTS

    from comm.store import open_store
    from engine.checkpoint import initial_checkpoint
    from engine.datasets import publish_dataset

    cores = os.cpu_count() or 1
    prov = provenance()
    rows: list[Row] = []
    skipped: list[str] = []
    with scratch("bubble") as root:
        url = (root / "store").as_uri()
        store = open_store(url)
        manifest = publish_dataset(store, "bubble", dataset_name(args.width, args.batch, args.steps), subset_size=64)
        initial_checkpoint(store, init_checkpoint_key("bubble"), MODEL, "sgd", LR, SEED, model_kwargs={"width": args.width})
        store.close()
        epoch = 0
        for k in args.stages:
            for m in args.microbatches:
                for name in sorted(args.schedules, key=SCHEDULES.index):
                    v = args.chunks if name == "interleaved" else 1
                    if name == "interleaved" and (m % k or BLOCKS % (k * v)):
                        skipped.append(f"interleaved k = {k}, M = {m} ("
                                       + ("M not a multiple of k" if m % k else
                                          f"{BLOCKS} blocks do not cut into {k * v} stages") + ")")
                        continue
                    began = time.perf_counter()
                    try:
                        row = run_one(name, k, m, v, url, epoch, manifest.n_subsets, args.steps,
                                      root / f"e{epoch}", args.width, args.batch)
                    except Exception as exc:
                        if name != "interleaved":
                            raise
                        source = _find(rows, "1f1b", k, m) or _find(rows, "gpipe", k, m)
                        row = simulated_only(name, k, m, v, source, _last_line(exc))
                        print(f"interleaved k={k} M={m}: not runnable by the executor ({row.error})", flush=True)
                    epoch += 1
                    rows.append(row)
                    print(f"{name} k={k} M={m}{f' v={v}' if v > 1 else ''}: ideal {row.ideal:.0%}, "
                          f"measured {_pct(row.measured)}, simulated {_pct(row.simulated_transfers)}, replayed {_pct(row.simulated_replay)}, "
                          f"peak MiB {' / '.join(_mib(row.peak_bytes(w)) for w in range(k)) if row.memory else '-'} "
                          f"[{row.source}] ({time.perf_counter() - began:.1f} s, "
                          f"load {os.getloadavg()[0]:.1f})", flush=True)
    add_fitting_simulations(rows, cores)
    write_report(rows, skipped, args, prov, cores, out)
    print("\n".join(goals(rows, args, cores)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

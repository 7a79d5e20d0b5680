"""Predicted vs measured iteration time under Local-SGD, pipeline and hybrid plans, in one run.

For `digits_cnn` (digits), a `resnet18`-shaped model (width 16) and a `vgg11`-shaped model
(hidden 128), both on synthetic 3x32x32 images, this does what `strategy=auto` does and then
checks it:

1. profile, as the flow's `profile` step does on a pool (`tasks.profile`), in a fresh process
   like the run's workers (`--profile`): `profile_model` at the job's
   batch with one torch thread (layers timed at the batch and at a quarter of it, calibrated
   to a pass through the whole chain; step and optimizer step), the store probe, a worker's
   put and get costs (`training.links.profile_transfers`), the sync checkpoint write, the
   store allreduce timed among 2 worker processes on the model's replica state, the
   contention factor at a typical activation, and the co-run slowdown of a step while a
   second worker process computes beside it (`training.corun`; the local pool's workers
   share this machine);
2. plan (predict): the profile dict goes through the coordinator's own
   `tasks.plan.strategy_inputs` into `planners.strategy.local_sgd` / `candidates`: Local-SGD
   is step + fitted scatter-reduce + checkpoint write; a pipeline or hybrid is the replay of
   its GPipe action lists on each stage's compute, upload and download threads
   (`planners.pipeline_time`);
3. measure: a short epoch (at least `--steps` iterations, and enough that the steady state
   lasts `--min-seconds` at the predicted pace) with every worker its own process
   (`python -m benchmarks.bench_prediction --worker`, one torch thread each, as the
   `inline` target starts them), against a directory store in a temporary folder (the
   embedded default: fsync per put).

Measured iteration time is the steady state: each worker timestamps the end of every
iteration (a small wrapper around `LocalSGD.after_step` / the stage loop's iteration,
installed only in the benchmark's worker processes); the first two iterations (warm-up)
are dropped, the median of the rest is taken per worker and the slowest worker counts.
Beside it stands the flow's own figure (`run_epoch.summarise`): the slowest worker's
`WorkerResult.iteration_s`, which each worker measures the same way
(`training.iteration_clock`), stamping after its sync where the benchmark stamps inside it.

Each error is split into terms so a miss can be named: compute (Local-SGD: the measured
step without its sync vs the profiled step; pipelines: the same replay fed with the stage
workers' measured forward/backward times and no transfers vs fed with the profile), sync
(measured time in the gradient/parameter sync vs the model) and transfer (the rest:
activation uploads, downloads, waits for a key). "Model fed with measured times" replays
with every measured duration: the model's own error, without the profile's.

Runs are grouped by whether worker processes outnumber the cores: with more processes than
cores a worker's compute is time-shared, which no term of the model knows about.

Noise floor: each configuration whose workers fit the cores runs `--repeats` times back to
back with the same profile, plan, code and iteration count; the later runs change nothing but
the column "measured again", and the summary gives how far the repeat's period lies from the
first run's. No prediction made before a run can be expected to come closer to it, in the
median, than the run comes to its own repeat.

Timing on these shared machines drifts: the same resnet18 pipeline ran at a 72 ms and a
98 ms period in two identical runs a minute apart, and one conv's median over 0.1 s windows
wanders by -11..+25 %, so a single run's errors carry that noise. One script timing four
resnet18 forward/backward passes at 8 rows in a fresh process took 113 ms, and 77 ms when
run again minutes later (no steal time reported either time). Part of what looked like
drift was our own processes: glibc's dynamic mmap threshold made a deep conv's backward
take 7-16.5 ms by what the process had allocated before; every worker and profile now pins
it (`training.malloc`).

    .venv/bin/python -m benchmarks.bench_prediction [--steps 14] [--min-seconds 3] [--trials 1] [--repeats 2] [--models ...]

Writes markdown with the command to `benchmarks/results/prediction.md`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from benchmarks.output import write_result
from training.iteration_clock import WARMUP, steady_gaps
from training.subprocess_env import one_thread_env

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "prediction.md"
WARMUP_ITERATIONS = WARMUP  # as the workers' own clocks


@dataclass(frozen=True)
class ModelCase:
    """One model of the sweep and the data it trains on."""

    model: str
    dataset: str
    batch: int
    model_kwargs: tuple = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.model_kwargs)


MODELS = {
    "digits_cnn": ModelCase("digits_cnn", "digits", 32),
    "resnet18": ModelCase("resnet18", "synthetic:3x32x32:10:512:64", 32, (("width", 16),)),
    "vgg11": ModelCase("vgg11", "synthetic:3x32x32:10:512:64", 16, (("hidden", 128),)),
}
# (strategy, D replicas, S stages): D x S worker processes each
PLANS = (("local_sgd", 1, 1), ("local_sgd", 2, 1), ("pipeline", 1, 2),
         ("local_sgd", 4, 1), ("pipeline", 1, 4), ("hybrid", 2, 2))
MICROBATCHES, LR, SEED, OPTIMIZER = 4, 0.05, 0, "sgd"


# --- the worker process: the engine, with timestamps -----------------------------------


def _now() -> float:
    # CLOCK_MONOTONIC on Linux: one clock for every process, so stages' stamps compare.
    return time.perf_counter()


def install_timers(t: dict) -> None:
    """Wrap the engine's loop points to append (start, end) stamps to the lists in `t`:
    `steps` (Local-SGD: compute end, sync end), `ckpt` (Local-SGD's sync checkpoint writes,
    inside the sync), `iterations`, `F`, `B`, `sync`, `put`, `read` (the read that found an
    activation's key) and `fetch` (a download thread's whole get: waiting, reading,
    deleting, decoding) of a pipeline stage worker, the last three with their keys. Only
    the benchmark's worker processes call this."""
    import torch

    from training import local_sgd, pipeline_executor

    for name in ("steps", "ckpt", "iterations", "F", "B", "sync", "put", "read", "fetch"):
        t.setdefault(name, [])
    inside = [False]  # validation forwards and the checkpoint are not iterations

    after_step = local_sgd.LocalSGD.after_step

    def timed_after_step(self):
        t0 = _now()
        after_step(self)
        t["steps"].append((t0, _now()))

    local_sgd.LocalSGD.after_step = timed_after_step
    save_checkpoint = local_sgd.save_checkpoint

    def timed_save_checkpoint(*args, **kwargs):
        t0 = _now()
        written = save_checkpoint(*args, **kwargs)
        t["ckpt"].append((t0, _now()))
        return written

    local_sgd.save_checkpoint = timed_save_checkpoint  # the sync checkpoint rank 0 writes

    worker = pipeline_executor._StageWorker
    init, iteration, sync, put = worker.__init__, worker._iteration, worker._sync_gradients, worker._put
    fetch = worker._fetch

    def timed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        began = [0.0]

        def forward_began(*_):
            began[0] = _now()

        def forward_ended(*_):
            if inside[0]:
                t["F"].append((began[0], _now()))

        self.module.register_forward_pre_hook(forward_began)
        self.module.register_forward_hook(forward_ended)
        store_type, read = type(self.store), type(self.store)._read

        def timed_read(store, key):
            t0 = _now()
            data = read(store, key)
            if data is not None and "/act/" in key:
                t["read"].append((t0, _now(), len(data), key))
            return data

        store_type._read = timed_read

    def timed_iteration(self, *args, **kwargs):
        inside[0], t0 = True, _now()
        try:
            return iteration(self, *args, **kwargs)
        finally:
            inside[0] = False
            t["iterations"].append((t0, _now()))

    def timed_sync(self, *args, **kwargs):
        t0 = _now()
        sync(self, *args, **kwargs)
        t["sync"].append((t0, _now()))

    def timed_put(self, key, tensor):
        t0 = _now()
        put(self, key, tensor)
        t["put"].append((t0, _now(), tensor.numel() * tensor.element_size(), key))

    def timed_fetch(self, key):
        t0 = _now()
        tensor = fetch(self, key)
        if inside[0]:
            t["fetch"].append((t0, _now(), key))
        return tensor

    worker.__init__, worker._iteration, worker._fetch = timed_init, timed_iteration, timed_fetch
    worker._sync_gradients, worker._put = timed_sync, timed_put

    backward = torch.Tensor.backward

    def timed_backward(self, *args, **kwargs):
        t0 = _now()
        backward(self, *args, **kwargs)
        if inside[0]:
            t["B"].append((t0, _now()))

    torch.Tensor.backward = timed_backward


def worker_main(spec_path: str, out_path: str, probes: dict | None = None) -> None:
    """Run one WorkerSpec (Local-SGD replica or pipeline stage) with timers, and each of
    `probes` (name -> installer filling a dict, e.g. a memory counter); write JSON."""
    import torch

    from training.run_spec import run_spec
    from training.specs import WorkerSpec
    from training.store import open_store

    torch.set_num_threads(1)
    timings: dict = {}
    install_timers(timings)
    measured = {name: {} for name in probes or {}}
    for name, install in (probes or {}).items():  # outside the timers: their bookkeeping is not stamped
        install(measured[name])
    spec = WorkerSpec.from_dict(json.loads(Path(spec_path).read_text()))
    store = open_store(spec.store_url)
    try:
        result = run_spec(spec, store)
    finally:
        store.close()
    Path(out_path).write_text(json.dumps({"result": result.to_dict(), "timings": timings, **measured}))


def run_workers(specs, scratch: Path, timeout_s: float = 300.0,
                module: str = "benchmarks.bench_prediction") -> list[dict]:
    """Start one worker process per spec (own process group, one torch thread), wait for all;
    return each one's {"result", "timings"} in spec order. A failure stops the others.
    `module` is the entry point each runs (`python -m <module> --worker SPEC --out JSON`):
    this module's `worker_main` unless a benchmark brings its own instrumented one."""
    env = one_thread_env()
    procs, outs = [], []
    for i, spec in enumerate(specs):
        spec_file, out_file = scratch / f"spec-{i}.json", scratch / f"out-{i}.json"
        spec_file.write_text(json.dumps(spec.to_dict()))
        out_file.unlink(missing_ok=True)
        log = open(scratch / f"worker-{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, "--worker", str(spec_file),
             "--out", str(out_file)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        outs.append(out_file)
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = (scratch / f"worker-{bad[0]}.log").read_text()[-1500:]
        raise RuntimeError(f"worker {bad[0]} exited {procs[bad[0]].returncode}:\n{tail}")
    return [json.loads(o.read_text()) for o in outs]


# --- profile and plan --------------------------------------------------------------------


def profile(case: ModelCase, store, url: str, run_id: str, classes: int) -> dict:
    """The profile dict the `profile` step would produce (`tasks.profile.profile`: one torch
    thread, layers at the job's batch with their per-call parts fitted, the store probe, a
    worker's put and get costs, the sync checkpoint write and a step right after it, the
    store collective timed among 2 worker processes, the contention factor at a typical
    activation), plus the layers re-timed at the micro-batch size (a diagnostic only)."""
    import torch

    from tasks.profile import microbatch_size, sync_bytes, typical_activation_bytes
    from training.corun import measure_corun
    from training.links import fit_scatter_reduce, probe_store_side, time_store_collective
    from training.models import build_model, input_shape
    from training.optimizers import build_optimizer
    from training.profiler import cpu_count, profile_layers, profile_model

    torch.set_num_threads(1)
    shape = input_shape(case.model, case.dataset)
    net = build_model(case.model, SEED, **case.kwargs)
    prof = profile_model(net, case.model, shape, classes, case.batch, base_memory=False,
                         thread_counts=(1,)).to_dict()
    prefix = f"runs/{run_id}/probe"
    nbytes = sync_bytes(prof, OPTIMIZER)
    largest = max([nbytes] + [l["output_bytes"] for l in prof["layers"]])
    gen = torch.Generator().manual_seed(SEED)
    xb = torch.randn(case.batch, *shape, generator=gen)
    yb = torch.randint(0, classes, (case.batch,), generator=gen)
    job = SimpleNamespace(batch_size=case.batch, microbatches=MICROBATCHES)
    activation = typical_activation_bytes(prof, job)
    probe = probe_store_side(store, prefix, net, build_optimizer(OPTIMIZER, net, LR), xb, yb, classes,
                             max_bytes=largest, microbatch_size=microbatch_size(job),
                             activation_bytes=activation)
    timing = time_store_collective(url, prefix, model=case.model, model_kwargs=case.kwargs,
                                   optimizer=OPTIMIZER, worlds=(2,),
                                   step={"input_shape": list(shape), "classes": classes, "batch_size": case.batch})
    sync_bw, sync_lat = fit_scatter_reduce(timing.samples)
    prof.update(store_bandwidth_bytes_per_s=probe["bandwidth_bytes_per_s"], store_latency_s=probe["latency_s"],
                store_transfer=probe["transfer"], synced_step_s=probe["synced_step_s"],
                checkpoint_s=probe["checkpoint_s"], contention=probe["contention"],
                store_sync={"samples": timing.samples, "bandwidth_bytes_per_s": sync_bw, "latency_s": sync_lat,
                            "handoff_s": timing.handoff_s, "synced_step_s": timing.synced_step_s})
    prof["corun"] = {**measure_corun(case.model, shape, classes, case.batch, model_kwargs=case.kwargs,
                                     optimizer=OPTIMIZER, seed=SEED,
                                     transfer_bytes=int(activation)).to_dict(),
                     "host_cores": cpu_count()}
    x = torch.randn(case.batch // MICROBATCHES, *shape, generator=torch.Generator().manual_seed(0))
    prof["layers_at_microbatch"] = [vars(l) for l in profile_layers(net, x)]
    return prof


def profile_main(args_path: str, out_path: str) -> None:
    """The profile of one model in this (fresh) process, as a pool worker runs the
    `profile` step; writes the profile dict as JSON."""
    from training.store import open_store

    a = json.loads(Path(args_path).read_text())
    store = open_store(a["url"])
    try:
        prof = profile(MODELS[a["model"]], store, a["url"], a["run_id"], a["classes"])
    finally:
        store.close()
    Path(out_path).write_text(json.dumps(prof))


def profile_in_fresh_process(case: ModelCase, url: str, run_id: str, classes: int, scratch: Path) -> dict:
    """`profile` in a new process with one torch thread, like the run's workers: the
    benchmark's own long-lived process has allocated, threaded and timed other models
    before, which a pool's profile worker has not."""
    scratch.mkdir(parents=True, exist_ok=True)
    args_file, out_file = scratch / "profile-args.json", scratch / "profile.json"
    args_file.write_text(json.dumps({"model": case.model, "url": url, "run_id": run_id, "classes": classes}))
    with open(scratch / "profile.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_prediction", "--profile", str(args_file),
                               "--out", str(out_file)], cwd=REPO, env=one_thread_env(), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"profile of {case.model} exited {proc.returncode}:\n"
                           + (scratch / "profile.log").read_text()[-1500:])
    return json.loads(out_file.read_text())


def strategy_inputs_for(case: ModelCase, prof: dict, n_train: int, workers: int, stages: int):
    """`tasks.plan.strategy_inputs` itself, given the few job and target fields it reads."""
    from tasks.plan import strategy_inputs

    job = SimpleNamespace(optimizer=OPTIMIZER, batch_size=case.batch, stages=stages,
                          microbatches=MICROBATCHES, sync_period=1)
    target = SimpleNamespace(kind="process", worker_vcpu=1.0, worker_memory_gb=2.0, worker_gpu=0)
    ctx = SimpleNamespace(job=job, resolved=SimpleNamespace(
        target=target, n_train=n_train, offer=SimpleNamespace(name="local")),
        price_per_worker_s=0.0)
    return strategy_inputs(ctx, prof, workers)


FREE = dict(put_latency_s=0.0, put_bandwidth=1e30, get_latency_s=0.0, get_bandwidth=1e30, handoff_s=0.0)


def predict(x, strategy: str, replicas: int, stages: int):
    """(plan, predicted terms {compute, transfer, sync}) for one configuration. A pipeline's
    terms come from the same model run three times: free transfers and a free sync
    (compute, bubble and optimizer step), real transfers, then the real sync too."""
    from planners.pipeline_time import TransferCosts
    from planners.strategy import candidates, local_sgd, local_sgd_step_s, pipeline_prediction

    if strategy == "local_sgd":
        plan = local_sgd(x, replicas)
        step = local_sgd_step_s(x, replicas)  # k = 1: every step follows a sync
        return plan, {"compute": step, "transfer": 0.0, "sync": plan.predicted_iteration_s - step}
    [plan] = candidates(replace(x, workers=replicas, stages=stages, microbatches=MICROBATCHES),
                        "pipeline" if replicas == 1 else "hybrid")
    free_sync = dict(sync_bandwidth=1e30, sync_latency=0.0)
    compute = pipeline_prediction(replace(x, transfer=TransferCosts(**FREE), **free_sync), plan).period_s
    with_transfer = pipeline_prediction(replace(x, **free_sync), plan).period_s
    return plan, {"compute": compute, "transfer": with_transfer - compute,
                  "sync": plan.predicted_iteration_s - with_transfer}


def predicted_at_microbatch(x, prof: dict, plan) -> float:
    """The pipeline prediction with every layer timed at the plan's micro-batch instead of
    scaled to it (a diagnostic of the per-call fit)."""
    from planners.strategy import pipeline_prediction

    layers = tuple({k: l[k] for k in ("forward_s", "backward_s", "output_bytes", "param_bytes")}
                   for l in prof["layers_at_microbatch"])
    return pipeline_prediction(replace(x, layers=layers, profile_batch=x.batch_size // MICROBATCHES),
                               plan).period_s


# --- measure -----------------------------------------------------------------------------


def steady(stamps: list, warmup: int = WARMUP_ITERATIONS) -> list[float]:
    """Iteration periods end-to-end after the first `warmup` iterations (the workers' own
    rule, `training.iteration_clock.steady_gaps`, on the benchmark's stamps)."""
    return steady_gaps([s[-1] if isinstance(s, (list, tuple)) else s for s in stamps], warmup)


def measured_terms(strategy: str, outs: list[dict], stages: int, handoff_s: float = 0.0,
                   optimizer_s=()) -> dict:
    """Measured iteration time (steady state, slowest worker), the flow's figure, and the
    same three terms as the prediction."""
    flow = max(o["result"]["iteration_s"] for o in outs)  # what run_epoch.summarise records
    if strategy == "local_sgd":
        per_worker = []
        for o in outs:
            s = o["timings"]["steps"]
            periods = steady(s)
            compute = [s[i][0] - s[i - 1][1] for i in range(WARMUP_ITERATIONS, len(s))]
            sync = [b - a for a, b in s[WARMUP_ITERATIONS:]]
            per_worker.append((statistics.median(periods), statistics.median(compute),
                               statistics.median(sync)))
        total, compute, sync = max(per_worker)
        ckpt = [b - a for o in outs for a, b in o["timings"]["ckpt"][WARMUP_ITERATIONS:]]
        return {"iteration": total, "flow": flow, "compute": compute, "sync": sync,
                "transfer": total - compute - sync, "model_runtime": compute,
                "sync_checkpoint": statistics.median(ckpt) if ckpt else 0.0}
    total = max(statistics.median(steady(o["timings"]["iterations"])) for o in outs)
    fwd, bwd, sync = [0.0] * stages, [0.0] * stages, 0.0
    # Means, not medians: the replay sums these actions along its critical path, and their
    # times have right tails in a run (compute 5-15 %, puts 10-40 % above the median).
    for o in outs:  # replica r's stage s is rank r * stages + s
        s = o["result"]["rank"] % stages
        t = o["timings"]
        fwd[s] = max(fwd[s], statistics.fmean(b - a for a, b in t["F"]))
        bwd[s] = max(bwd[s], statistics.fmean(b - a for a, b in t["B"]))
        if t["sync"]:
            sync = max(sync, statistics.median(b - a for a, b in t["sync"][WARMUP_ITERATIONS:]))
    # the prediction's model fed with each stage's measured F, B, put, get and sync times
    from planners.pipeline_time import TransferCosts, pipeline_iteration

    puts = [b - a for o in outs for a, b, *_ in o["timings"]["put"]]
    # a get's own part: from the read that found the key to the decoded tensor (the wait
    # before it is the hand-off, which the replay adds where a reader waits)
    gets = []
    for o in outs:
        found = {r[3]: r[0] for r in o["timings"]["read"]}
        gets += [end - found[key] for _, end, key in o["timings"]["fetch"] if key in found]
    stage_rows = [{"forward_s": fwd[s], "backward_s": bwd[s], "out_bytes": 0.0} for s in range(stages)]
    costs = TransferCosts(statistics.fmean(puts) if puts else 0.0, 1e30,
                          statistics.fmean(gets) if gets else 0.0, 1e30, handoff_s)
    fed = pipeline_iteration(stage_rows, MICROBATCHES, costs, sync_s=[sync] * stages if sync else (),
                             optimizer_s=optimizer_s).period_s
    compute = pipeline_iteration(stage_rows, MICROBATCHES, TransferCosts(**FREE),
                                 optimizer_s=optimizer_s).period_s
    return {"iteration": total, "flow": flow, "compute": compute, "sync": sync,
            "transfer": total - compute - sync, "model_runtime": fed}


def worker_specs(case: ModelCase, strategy: str, replicas: int, plan, url: str, run_id: str,
                 epoch: int, n_subsets: int, steps: int):
    """The WorkerSpecs `run_epoch.worker_specs` would build for this plan (short epoch)."""
    from training.datasets import assign_subsets
    from training.pipeline_executor import pipeline_worker_specs
    from training.specs import WorkerSpec

    shards = assign_subsets(n_subsets, replicas, epoch, SEED)
    base = WorkerSpec(run_id=run_id, epoch=epoch, rank=0, world=replicas, store_url=url,
                      model=case.model, dataset=case.dataset, subsets=(), steps=steps,
                      batch_size=case.batch, lr=LR, optimizer=OPTIMIZER, sync_period=1, seed=SEED,
                      init_key=f"runs/{run_id}/init", out_key=f"runs/{run_id}/out-e{epoch}",
                      sync_timeout_s=300.0, evaluate=False,
                      extra={"strategy": strategy, "model_kwargs": case.kwargs})
    if strategy == "local_sgd":
        return [replace(base, rank=r, subsets=tuple(shards[r])) for r in range(replicas)]
    # a planner cut i splits after layer i; the executor's cut is where a stage begins
    return pipeline_worker_specs(base, cuts=[c + 1 for c in plan.cuts], microbatches=MICROBATCHES,
                                 replica_subsets=shards)


@dataclass
class Row:
    """One configuration's prediction next to its measurement (None: the run failed)."""

    model: str
    strategy: str
    replicas: int
    stages: int
    cuts: tuple
    predicted: dict
    measured: dict | None
    predicted_at_microbatch: float | None
    load: tuple
    note: str = ""
    trial: int = 0
    steps: int = 0
    again: tuple = ()  # iteration periods of the same run repeated right after (noise floor)

    @property
    def workers(self) -> int:
        return self.replicas * self.stages

    @property
    def error(self) -> float | None:
        """Signed relative error of the prediction, (predicted - measured) / measured."""
        if self.measured is None:
            return None
        return self.predicted["iteration"] / self.measured["iteration"] - 1

    @property
    def fed(self) -> float | None:
        """The model's formula fed with this run's measured compute (and, for pipelines,
        activation upload and read) times, plus the modelled sync: the formula's own error,
        without the profile's."""
        return None if self.measured is None else self.measured["model_runtime"] + self.predicted["sync"]

    @property
    def drift(self) -> float | None:
        """How far the first repeat's period lies from this run's: what the machine alone
        moves a measurement, with the same code, plan and profile."""
        if self.measured is None or not self.again:
            return None
        return self.again[0] / self.measured["iteration"] - 1

    def worst_term(self) -> str:
        """The term whose predicted - measured gap is the largest in absolute seconds."""
        if self.measured is None:
            return "-"
        gaps = {k: self.predicted[k] - self.measured[k] for k in ("compute", "transfer", "sync")}
        k = max(gaps, key=lambda k: abs(gaps[k]))
        return f"{k} {gaps[k] * 1e3:+.1f} ms"


def steps_for(predicted_s: float, steps: int, min_seconds: float, cap: int = 5000) -> int:
    """Iterations of a run: at least `steps`, and enough that the steady state (after the
    warm-up) lasts `min_seconds` at the predicted pace: a period measured over a fraction of
    a second catches one moment of the machine's wandering speed."""
    wanted = WARMUP_ITERATIONS + 1 + math.ceil(min_seconds / max(predicted_s, 1e-4))
    return max(steps, min(cap, wanted))


def measure_plan(case: ModelCase, prof: dict, x, strategy: str, replicas: int, stages: int,
                 plan, terms: dict, *, url: str, run_id: str, epoch: int, manifest, steps: int,
                 root: Path, note: str = "") -> Row:
    """Run one plan's short epoch and return its row (a failed run keeps its error as note)."""
    from planners.pipeline_time import stage_times
    from planners.strategy import optimizer_shares

    at_mb = handoff_s = None
    optimizer_s = ()
    if strategy != "local_sgd":
        at_mb = predicted_at_microbatch(x, prof, plan)
        handoff_s = x.transfer_costs.handoff_s
        optimizer_s = optimizer_shares(x.optimizer_step_s, [st["param_bytes"] for st in
                                                            stage_times(x.layers, plan.cuts, 1, x.profile_batch)])
    specs = worker_specs(case, strategy, replicas, plan, url, run_id, epoch, manifest.n_subsets, steps)
    scratch = root / f"e{epoch}"
    scratch.mkdir()
    before = os.getloadavg()[0]
    measured = None
    try:
        measured = measured_terms(strategy, run_workers(specs, scratch), stages, handoff_s or 0.0,
                                  optimizer_s)
    except RuntimeError as exc:
        note = "run failed: " + str(exc).strip().splitlines()[-1][:160]
    return Row(case.model, strategy, replicas, stages, tuple(plan.cuts),
               {"iteration": plan.predicted_iteration_s, **terms}, measured, at_mb,
               (before, os.getloadavg()[0]), note, steps=steps)


def run_model(case: ModelCase, root: Path, steps: int, log, min_seconds: float = 0.0,
              repeats: int = 1, cores: int = 1) -> list[Row]:
    """Profile, plan and measure every configuration of PLANS for one model; a configuration
    whose worker processes fit the cores runs `repeats` times back to back (the later runs
    only give the row its `again` periods)."""
    from training.checkpoint import initial_checkpoint
    from training.datasets import publish_dataset
    from training.store import open_store

    run_id = f"pred-{case.model}"
    url = (root / "store").as_uri()
    store = open_store(url)
    manifest = publish_dataset(store, run_id, case.dataset, subset_size=64)
    initial_checkpoint(store, f"runs/{run_id}/init", case.model, OPTIMIZER, LR, SEED, case.kwargs)
    t0 = time.perf_counter()
    prof = profile_in_fresh_process(case, url, run_id, manifest.classes, root / "profile")
    log(f"{case.model}: profiled in {time.perf_counter() - t0:.1f} s (step {prof['step_s'] * 1e3:.1f} ms, "
        f"store {prof['store_bandwidth_bytes_per_s'] / 1e6:.0f} MB/s + {prof['store_latency_s'] * 1e3:.2f} ms, "
        f"contention {prof['contention']:.2f}, co-run {prof['corun']['factor']:.2f}, "
        f"transfer wake {prof['corun']['transfer_extra_s'] * 1e3:.2f} ms)")
    rows, epoch = [], 0
    for strategy, replicas, stages in PLANS:
        x = strategy_inputs_for(case, prof, manifest.n_train, replicas, stages if stages > 1 else None)
        plan, terms = predict(x, strategy, replicas, stages)
        for p, t, note in [(plan, terms, "")]:
            t0 = time.perf_counter()
            row = measure_plan(case, prof, x, strategy, replicas, stages, p, t, url=url, run_id=run_id,
                               epoch=epoch, manifest=manifest, root=root, note=note,
                               steps=steps_for(p.predicted_iteration_s, steps, min_seconds))
            epoch += 1
            again = []
            for _ in range(repeats - 1 if row.measured is not None and row.workers <= cores else 0):
                rerun = measure_plan(case, prof, x, strategy, replicas, stages, p, t, url=url, run_id=run_id,
                                     epoch=epoch, manifest=manifest, root=root, steps=row.steps)
                epoch += 1
                if rerun.measured is not None:
                    again.append(rerun.measured["iteration"])
            row = replace(row, again=tuple(again))
            rows.append(row)
            what = row.note if row.measured is None else \
                f"measured {row.measured['iteration'] * 1e3:.1f} ms ({row.error:+.1%})" + (
                    "" if row.drift is None else f", again {row.again[0] * 1e3:.1f} ms ({row.drift:+.1%})")
            log(f"  {strategy} {replicas}x{stages} cuts {list(p.cuts)}, {row.steps} steps: predicted "
                f"{row.predicted['iteration'] * 1e3:.1f} ms, {what}, {time.perf_counter() - t0:.1f} s, "
                f"load {row.load[0]:.1f}")
    store.close()
    return rows


# --- report ------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def table(rows: list[Row]) -> list[str]:
    """Markdown rows: prediction, measurement, error and the terms of each."""
    out = ["| model | plan | workers | cuts | steps | predicted ms | measured ms | error | flow's measured_iteration_s ms | "
           "pred. compute / transfer / sync ms | meas. compute / transfer+rest / sync ms | "
           "largest gap (pred - meas) | pred. with layers timed at the micro-batch ms | "
           "model fed with measured times ms | measured again ms | load avg |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, m = r.predicted, r.measured
        head = (f"| {r.model} | {r.strategy} {r.replicas}x{r.stages} | {r.workers} | "
                f"{list(r.cuts) or '-'} | {r.steps} | {_ms(p['iteration'])} |")
        pred_terms = f"{_ms(p['compute'])} / {_ms(p['transfer'])} / {_ms(p['sync'])}"
        if m is None:
            out.append(f"{head} - | - | - | {pred_terms} | - | - | - | - | - | {r.load[0]:.1f}-{r.load[1]:.1f} |")
            continue
        ckpt = f" (ckpt {_ms(m['sync_checkpoint'])})" if m.get("sync_checkpoint") else ""
        again = ", ".join(f"{_ms(a)} ({a / m['iteration'] - 1:+.0%})" for a in r.again) or "-"
        at_mb = "-" if r.predicted_at_microbatch is None else \
            f"{_ms(r.predicted_at_microbatch)} ({r.predicted_at_microbatch / m['iteration'] - 1:+.0%})"
        out.append(
            f"{head} {_ms(m['iteration'])} | {r.error:+.1%} | {_ms(m['flow'])} | {pred_terms} | "
            f"{_ms(m['compute'])} / {_ms(m['transfer'])} / {_ms(m['sync'])}{ckpt} | {r.worst_term()} | "
            f"{at_mb} | {_ms(r.fed)} ({r.fed / m['iteration'] - 1:+.0%}) | {again} | {r.load[0]:.1f}-{r.load[1]:.1f} |")
    notes = [f"- {r.model} {r.strategy} {r.replicas}x{r.stages} {list(r.cuts)}: {r.note}"
             for r in rows if r.note]
    return out + ([""] + notes if notes else [])


def summary(rows: list[Row], cores: int) -> list[str]:
    """Median absolute error within and beyond the core count (and per trial when several)."""
    lines = []
    for label, keep in (("worker processes <= cores", lambda r: r.workers <= cores),
                        ("worker processes > cores", lambda r: r.workers > cores)):
        done = [r for r in rows if keep(r) and r.measured is not None]
        if done:
            errs = [abs(r.error) for r in done]
            fed = [abs(r.fed / r.measured["iteration"] - 1) for r in done]
            trials = sorted({r.trial for r in done})
            per_trial = "" if len(trials) < 2 else "; per trial " + ", ".join(
                f"{statistics.median(abs(r.error) for r in done if r.trial == t):.1%}" for t in trials)
            lines.append(f"- {label} ({cores} cores): median |error| of the prediction "
                         f"**{statistics.median(errs):.1%}** over {len(errs)} runs (min {min(errs):.1%}, "
                         f"max {max(errs):.1%}{per_trial}); of the model fed with the run's measured times "
                         f"{statistics.median(fed):.1%}")
            drifts = [abs(r.drift) for r in done if r.drift is not None]
            if drifts:
                again = [abs(r.predicted["iteration"] / a - 1) for r in done for a in r.again]
                lines.append(f"  - the same run repeated right after it (same profile, plan and code): its period "
                             f"differs from the first run's by a median **{statistics.median(drifts):.1%}** "
                             f"(max {max(drifts):.1%}, {len(drifts)} pairs); the prediction's median |error| "
                             f"against the repeats is {statistics.median(again):.1%}")
    return lines


def write_report(rows: list[Row], args, seconds: float, cores: int) -> None:
    """benchmarks/results/prediction.md with the command that produced it."""
    command = "    .venv/bin/python -m benchmarks.bench_prediction " + " ".join(
        ["--steps", str(args.steps), "--min-seconds", f"{args.min_seconds:g}", "--trials", str(args.trials),
         "--repeats", str(args.repeats),
         "--models", *args.models])
    within = [r for r in rows if r.workers <= cores]
    beyond = [r for r in rows if r.workers > cores]
    md = ["# Predicted vs measured iteration time", "",
          f"Command (run from the repository root; {seconds:.0f} s on {cores} cores, "
          f"{platform.processor() or platform.machine()}, torch threads 1 per worker):", "", command, "",
          "Method: see the module docstring of `benchmarks/bench_prediction.py`. Predicted = what "
          "`planners.strategy` gives for the profile (one torch thread, layers timed at the job's "
          "batch and at a quarter of it and interpolated to the micro-batch, as `strategy=auto` "
          "does); measured = steady-state "
          f"iteration period of the slowest worker over the run's iterations (at least {args.steps}, "
          f"and enough for {args.min_seconds:g} s at the predicted pace; column `steps`) minus "
          f"{WARMUP_ITERATIONS} warm-up ones; error = predicted / measured - 1. Local-SGD syncs "
          f"every step (k = 1); pipelines use {MICROBATCHES} micro-batches; the directory store "
          "is the embedded default in a temporary folder. `load avg` is the machine's 1-minute "
          "load before and after the run (the run's own worker processes included).", "",
          "## Summary", "", *summary(rows, cores), "",
          f"## Worker processes <= cores ({cores})", "", *table(within), "",
          f"## Worker processes > cores ({cores})", "", *table(beyond), ""]
    write_result(RESULTS, "\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (or, with --worker, one instrumented worker) and write the report."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_prediction", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=14, help="least iterations per run (>= 4)")
    parser.add_argument("--min-seconds", type=float, default=3.0,
                        help="least steady-state seconds per run at the predicted pace (more iterations for fast plans)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--trials", type=int, default=1,
                        help="profile-plan-measure each model this many times (rows of every trial count)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each configuration whose workers fit the cores, back to back; the "
                             "first is the measurement, the others show how far the machine alone moves it")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.out)
        return 0
    if args.profile:
        profile_main(args.profile, args.out)
        return 0
    if args.steps < WARMUP_ITERATIONS + 2:
        parser.error(f"--steps must be at least {WARMUP_ITERATIONS + 2}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    rows = []
    for trial in range(args.trials):
        # trial after trial, not model after model: a drift in the machine's speed then
        # touches every model instead of one
        for name in args.models:
            root = Path(tempfile.mkdtemp(prefix=f"zooid-pred-{name}-"))
            try:
                rows += [replace(r, trial=trial) for r in
                         run_model(MODELS[name], root, args.steps, lambda s: print(s, flush=True),
                                   args.min_seconds, args.repeats, cores)]
            finally:
                shutil.rmtree(root, ignore_errors=True)
    write_report(rows, args, time.perf_counter() - t0, cores)
    print("\n".join(summary(rows, cores)))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

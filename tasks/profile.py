"""The `profile` step: measure the model on this hardware and the store it will sync through.

The model profile is cached by Prefect, keyed on model, input shape, batch size and hardware,
so a second run of the same job does not profile again; the store probe is cheap and always
measured, since a store's speed depends on where it is. The store collective (Local-SGD's
average, timed among real worker processes) costs seconds of process start-up, so it is
cached for a day per kind of store, hardware and size. Where the workers will share this
machine (the `inline` and local `process` targets), the step is also timed in two worker
processes at once (`training.corun`), cached the same way: the slowdown a plan's compute
pays for its neighbours.
"""
from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from urllib.parse import urlsplit

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RunContext
from tasks.plan import SHARED_HOST_KINDS
from tasks.retry import task_options


def _hardware() -> str:
    from training.profiler import hardware_fingerprint

    return hardware_fingerprint(threads=1)  # the tasks measure at one thread, as workers run


def _profile_cache_key(context, params) -> str:
    key = {k: params[k] for k in ("model", "input_shape", "classes", "batch_size", "optimizer")}
    key["hardware"] = _hardware()
    key["version"] = 4  # 4: allocator pinned (training.malloc), anchors sampled >= 0.3 s
    return "zooid-profile-" + hashlib.sha256(json.dumps(key, sort_keys=True, default=list).encode()).hexdigest()[:32]


@task(name="profile-model", cache_key_fn=_profile_cache_key, persist_result=True,
      result_serializer="json", retries=1, retry_delay_seconds=2, timeout_seconds=600)
def profile_model(model: str, input_shape: list[int], classes: int, batch_size: int, seed: int = 0,
                  optimizer: str = "sgd") -> dict:
    """Per-layer and per-step timings of `model` at `batch_size` (JSON-able dict)."""
    from training.models import build_model
    from training.profiler import profile_model as measure

    import torch

    torch.set_num_threads(1)  # workers run one thread each; profile what they will see
    net = build_model(model, seed)
    return measure(net, model, tuple(input_shape), classes, batch_size, optimizer=optimizer).to_dict()


@task(name="probe-store", cache_policy=NO_CACHE, **task_options(retries=2, timeout_s=120))
def probe_store(ctx: RunContext, max_bytes: float = 0, activation_bytes: float = 0) -> dict:
    """The store's fitted bandwidth (bytes/s) and latency (s) in the contract's form, a
    worker's put and get costs up to `max_bytes` (`training.links.profile_transfers`), the
    seconds of the sync checkpoint rank 0 writes (the job's model and optimizer) and of a
    step right after it, and, with `activation_bytes` (a pipeline may be planned), the
    contention factor: compute at the micro-batch slowed by transfers of that size
    (FuncPipe's beta). One torch thread, as a worker runs."""
    import torch

    from training.links import probe_store_side
    from training.models import build_model
    from training.optimizers import build_optimizer

    job, r = ctx.job, ctx.resolved
    net = build_model(job.model, job.seed)
    gen = torch.Generator().manual_seed(job.seed)
    x = torch.randn(job.batch_size, *r.input_shape, generator=gen)
    y = torch.randint(0, r.classes, (job.batch_size,), generator=gen)
    store = ctx.open_store()
    try:
        return probe_store_side(store, ctx.prefix("probe"), net, build_optimizer(job.optimizer, net, job.lr),
                                x, y, r.classes, max_bytes=max_bytes, microbatch_size=microbatch_size(job),
                                activation_bytes=activation_bytes)
    finally:
        store.close()


def microbatch_size(job) -> int:
    """Rows per micro-batch of a pipeline of this job (the planner's default split)."""
    from planners.strategy import microbatch_count

    return max(1, job.batch_size // microbatch_count(job.batch_size, job.microbatches))


def typical_activation_bytes(prof: dict, job) -> float:
    """The median layer output at the micro-batch: what a stage typically sends per
    micro-batch, the transfer size the contention factor is measured with."""
    outputs = sorted(l["output_bytes"] for l in prof.get("layers", ()))
    if not outputs:
        return 0.0
    return outputs[len(outputs) // 2] * microbatch_size(job) / (prof.get("microbatch_size") or prof["batch_size"])


def _collective_cache_key(context, params) -> str:
    parts = urlsplit(params["store_ref"])
    # the kind of store and where it is, not the run's folder; hashed: a URL may hold a password
    where = hashlib.sha256(f"{parts.scheme}://{parts.netloc}".encode()).hexdigest()[:16]
    key = {"where": where, "model": params["model"], "optimizer": params["optimizer"],
           "worlds": list(params["worlds"]), "step": params.get("step"), "hardware": _hardware(), "version": 4}
    return "zooid-collective-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


@task(name="time-store-collective", cache_key_fn=_collective_cache_key, persist_result=True,
      result_serializer="json", cache_expiration=timedelta(days=1), retries=1, retry_delay_seconds=2,
      timeout_seconds=600)
def time_collective(store_ref: str, run_prefix: str, model: str, optimizer: str, worlds: list[int],
                    step: dict | None = None) -> dict:
    """Local-SGD's store allreduce of `model`'s replica state timed among `worlds` worker
    processes, the effective bandwidth and latency of the scatter-reduce model fitted to
    it, and the hand-off delay between two of those processes (what a pipeline stage
    waiting for its neighbour's tensor pays); with `step` (input_shape, classes, batch_size),
    a training step timed right after each sync in both processes."""
    from training.links import fit_scatter_reduce, time_store_collective

    timing = time_store_collective(store_ref, run_prefix, model=model, optimizer=optimizer,
                                   worlds=tuple(worlds), opener="blocks.store:open_store_ref", step=step)
    bw, lat = fit_scatter_reduce(timing.samples)
    return {"samples": [list(s) for s in timing.samples], "bandwidth_bytes_per_s": bw, "latency_s": lat,
            "handoff_s": timing.handoff_s, "synced_step_s": timing.synced_step_s}


def _corun_cache_key(context, params) -> str:
    key = {k: params[k] for k in ("model", "input_shape", "classes", "batch_size", "optimizer", "transfer_bytes")}
    key["hardware"] = _hardware()
    key["version"] = 2
    return "zooid-corun-" + hashlib.sha256(json.dumps(key, sort_keys=True, default=list).encode()).hexdigest()[:32]


@task(name="time-corun", cache_key_fn=_corun_cache_key, persist_result=True, result_serializer="json",
      cache_expiration=timedelta(days=1), retries=1, retry_delay_seconds=2, timeout_seconds=300)
def time_corun(model: str, input_shape: list[int], classes: int, batch_size: int, optimizer: str,
               seed: int = 0, transfer_bytes: int = 0) -> dict:
    """The training step of `model` timed in one worker process alone and in two at once on
    this machine (`training.corun`), with the machine's cores: how much a plan's compute
    slows when its worker processes share the machine (`inline` and local targets); with
    `transfer_bytes` (a pipeline may be planned), also what a stage's put and get of that
    size pay beyond the profile's timing while the machine computes."""
    from training.corun import measure_corun
    from training.profiler import cpu_count

    measured = measure_corun(model, tuple(input_shape), classes, batch_size, optimizer=optimizer, seed=seed,
                             transfer_bytes=transfer_bytes)
    return {**measured.to_dict(), "host_cores": cpu_count()}


def allreduce_fit(samples, store_bandwidth: float) -> dict:
    """The hybrid contract's ring allreduce alpha and beta (the profile's
    `allreduce_alpha_s_per_byte`, `allreduce_beta_s`), fitted to the timed store allreduce
    `samples` beyond the store's bandwidth; zeros when they cannot be told apart (fewer than
    two sizes)."""
    from planners.errors import PlannerInputError
    from training.links import fit_allreduce_samples

    try:
        alpha, beta, _ = fit_allreduce_samples([tuple(s) for s in samples], store_bandwidth)
    except PlannerInputError:
        alpha = beta = 0.0
    return {"allreduce_alpha_s_per_byte": alpha, "allreduce_beta_s": beta}


def sync_bytes(prof: dict, optimizer: str) -> float:
    """Bytes one Local-SGD average moves: the parameters and the optimizer's moments."""
    from tasks.plan import optimizer_copies

    return prof["param_bytes"] * (1 + optimizer_copies(optimizer))


def profile(ctx: RunContext) -> dict:
    """The profile step: model profile (cached), store probe and, when a plan may have
    several workers, the store collective and, on a shared machine, the co-run slowdown
    (both cached)."""
    r, job = ctx.resolved, ctx.job
    prof = dict(profile_model(job.model, list(r.input_shape), r.classes, job.batch_size, job.seed,
                              job.optimizer))
    nbytes = sync_bytes(prof, job.optimizer)
    largest = max([nbytes] + [l["output_bytes"] for l in prof.get("layers", ())])
    # a pipeline may be planned: the probes time transfers of its typical activation
    activation = typical_activation_bytes(prof, job) if job.strategy != "local_sgd" else 0.0
    probe = probe_store(ctx, largest, activation)
    prof["store_bandwidth_bytes_per_s"] = probe["bandwidth_bytes_per_s"]
    prof["store_latency_s"] = probe["latency_s"]
    prof["store_transfer"] = probe["transfer"]
    prof["checkpoint_s"] = probe["checkpoint_s"]
    prof["synced_step_s"] = probe["synced_step_s"]
    prof["contention"] = probe["contention"]
    prof["store_sync"] = None
    if job.max_workers > 1 and job.collective == "store":
        step = {"input_shape": list(r.input_shape), "classes": r.classes, "batch_size": job.batch_size}
        prof["store_sync"] = time_collective(ctx.store_ref, ctx.prefix("probe"), job.model, job.optimizer, [2],
                                             step if ctx.resolved.target.kind in SHARED_HOST_KINDS else None)
        prof.update(allreduce_fit(prof["store_sync"]["samples"], prof["store_bandwidth_bytes_per_s"]))
    prof["corun"] = None
    if job.max_workers > 1 and ctx.resolved.target.kind in SHARED_HOST_KINDS:
        prof["corun"] = time_corun(job.model, list(r.input_shape), r.classes, job.batch_size, job.optimizer,
                                   job.seed, int(activation))
    return prof

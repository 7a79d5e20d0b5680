"""The `profile` step: the model and the store, measured where the workers run, and cached.

The coordinator never times a model whose workers run elsewhere: a worker on the target
measures it (`profiling.profile_job`), on its device and at its thread count, with the store
seen from where it runs. That worker is the run's first warm worker, or, for a cold run or a
dry run, a one-off worker on the same pool and offer, stopped once it answered (and billed).

Results are cached in the durable store, so a second run profiles nothing on any machine
that reads that store (`profile_cache`):

- `cache/targets/<key>.json`: what a target's workers are (device, threads, torch version),
  keyed by the target's launch settings; it tells a later run the model key to look up
  before any worker starts;
- `cache/profiles/<key>.json`: the model's profile, keyed by model identity (registry name,
  or import path plus a hash of the module's source), input shape, classes, batch size,
  micro-batch size, optimizer, device name, threads and torch version;
- `cache/stores/<key>.json`: the store probe, keyed by the model key and where the store is,
  kept for a day (a store's speed drifts; the epochs recalibrate anyway).

The run log says what was measured, what came from the cache and how long it took.
"""
from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from core.errors import ZooidValueError
from profiling.profile_job import ProfileRequest
from tasks.context import RunContext
from tasks.launchers import worker_threads
from tasks.profile_cache import ProfileCache, model_key, store_key, target_key
from tasks.retry import task_options

STORE_PROBE_TTL_S = 24 * 3600.0


def microbatch_size(job) -> int:
    """Rows per micro-batch of a pipeline of this job (the planner's default split)."""
    from planners.strategy import job_microbatches

    return max(1, job.batch_size // job_microbatches(job.batch_size, job.microbatches))


def typical_activation_bytes(prof: dict, job) -> float:
    """The median layer output at the micro-batch: what a stage typically sends per
    micro-batch, the transfer size the contention factor is measured with."""
    outputs = sorted(l["output_bytes"] for l in prof.get("layers", ()))
    if not outputs:
        return 0.0
    return outputs[len(outputs) // 2] * microbatch_size(job) / (prof.get("microbatch_size") or prof["batch_size"])


def sync_bytes(prof: dict, optimizer: str) -> float:
    """Bytes one Local-SGD average moves: the parameters and the optimizer's moments."""
    from tasks.plan import optimizer_copies

    return prof["param_bytes"] * (1 + optimizer_copies(optimizer))


def profile_threads(ctx: RunContext) -> int:
    """Torch threads the profiling worker runs: those of a worker of the job's first plan."""
    from tasks.warm_pool import provisional_plan

    return worker_threads(ctx.resolved.target.kind, provisional_plan(ctx))


def profile_request(ctx: RunContext, *, model_profile: bool, probe: dict | None) -> ProfileRequest:
    """What the target's worker is asked to measure (`probe`: the store probe's sizes, None:
    no store probe)."""
    job, r = ctx.job, ctx.resolved
    return ProfileRequest(
        model=job.model, input_shape=tuple(r.input_shape), classes=r.classes, batch_size=job.batch_size,
        microbatch_size=microbatch_size(job), optimizer=job.optimizer, lr=job.lr, seed=job.seed,
        threads=profile_threads(ctx),
        device="cuda" if r.target.worker_gpu > 0 else "auto", model_profile=model_profile,
        store_url=ctx.store_ref if probe is not None else "", probe_prefix=ctx.prefix("probe"),
        max_bytes=(probe or {}).get("max_bytes", 0.0), activation_bytes=(probe or {}).get("activation_bytes", 0.0))


def check_device(identity: dict, worker_gpu: int) -> None:
    """A job whose workers have GPUs is never planned from a CPU profile."""
    if worker_gpu > 0 and identity.get("device") != "cuda":
        raise ZooidValueError("worker_gpu", f"the target's workers have {worker_gpu} GPU(s) but the profile was "
                                            f"taken on {identity.get('device')} ({identity.get('device_name')}); "
                                            "a GPU job is planned only from a profile taken on its GPU")


class TargetProfiler:
    """Sends profile requests to a worker on the target: the run's first warm worker, or one
    one-off worker on the same pool and offer, started at the first request and stopped
    (its keys deleted, its time billed like any worker's) when the profile step ends."""

    def __init__(self, ctx: RunContext):
        self.ctx, self.one_off = ctx, None

    def measure(self, request: ProfileRequest) -> dict:
        from tasks.warm_pool import WarmPool, provisional_plan

        ctx = self.ctx
        pool = ctx.state.warm
        if pool is None:
            pool = self.one_off = self.one_off or WarmPool(ctx)
        return pool.profile(provisional_plan(ctx), request.to_dict(), ctx.job.worker_timeout_s)

    def close(self) -> None:
        if self.one_off is not None:
            from runtime.warm import warm_prefix

            self.one_off.stop_all("the profile is taken")
            store = self.ctx.open_durable()
            try:
                store.delete_prefix(warm_prefix(self.ctx.run_id) + "/")
            finally:
                store.close()
            self.one_off = None


def _store_probe_sizes(ctx: RunContext, prof: dict) -> dict:
    job = ctx.job
    largest = max([sync_bytes(prof, job.optimizer)] + [l["output_bytes"] for l in prof.get("layers", ())])
    activation = typical_activation_bytes(prof, job) if job.strategy != "local_sgd" else 0.0
    return {"max_bytes": float(largest), "activation_bytes": float(activation)}


def _profile(ctx: RunContext) -> dict:
    """The model profile and store probe for `ctx`'s job, from the cache where it has them."""
    began = time.perf_counter()
    job, target = ctx.job, ctx.resolved.target
    cache = ProfileCache(ctx.open_durable)
    tkey = target_key(ctx, profile_threads(ctx))
    identity = cache.target_identity(tkey)
    prof = store = None
    target_profiler = TargetProfiler(ctx)
    if identity is not None:
        mkey = model_key(ctx, identity, microbatch_size(job))
        prof = cache.get("profiles", mkey)
        store = cache.get("stores", store_key(mkey, ctx.store_ref, job.strategy != "local_sgd"), max_age_s=STORE_PROBE_TTL_S)
    sources, seconds = {"model": "cache", "store": "cache"}, {}
    try:
        if prof is None:
            answer = target_profiler.measure(profile_request(ctx, model_profile=True, probe=None))
            identity = answer["identity"]
            check_device(identity, target.worker_gpu)
            cache.put_target_identity(tkey, identity)
            mkey = model_key(ctx, identity, microbatch_size(job))
            prof, sources["model"], seconds["model_s"] = answer["model"], "measured", answer["model_s"]
            cache.put("profiles", mkey, prof)
            store = cache.get("stores", store_key(mkey, ctx.store_ref, job.strategy != "local_sgd"), max_age_s=STORE_PROBE_TTL_S)
        if store is None:  # its sizes follow from the model: the largest tensor, a stage's activation
            answer = target_profiler.measure(profile_request(ctx, model_profile=False,
                                                             probe=_store_probe_sizes(ctx, prof)))
            store, sources["store"], seconds["store_s"] = answer["store"], "measured", answer["store_s"]
            cache.put("stores", store_key(mkey, ctx.store_ref, job.strategy != "local_sgd"), store)
    finally:
        target_profiler.close()
    check_device(identity, target.worker_gpu)
    out = dict(prof)
    out.update(identity=identity, device=identity["device"], device_name=identity["device_name"],
               threads=identity["threads"], torch=identity["torch"],
               store_bandwidth_bytes_per_s=store["bandwidth_bytes_per_s"], store_latency_s=store["latency_s"],
               store_transfer=store["transfer"], checkpoint_s=store["checkpoint_s"],
               synced_step_s=store["synced_step_s"], contention=store["contention"],
               profile_sources=sources, profile_s=time.perf_counter() - began)
    measured = ", ".join(f"{k} {'measured in ' + format(seconds[k + '_s'], '.1f') + ' s' if v == 'measured' else 'from the cache'}"
                         for k, v in sources.items())
    print(f"zooid profile of {job.model} on {identity['device']} ({identity['device_name']}, "
          f"{identity['threads']} thread(s), torch {identity['torch']}): {measured}; "
          f"{out['profile_s']:.1f} s in all")
    return out


def profile(ctx: RunContext) -> dict:
    """Profile the job's model and store on the target (`tasks.profile` module docs).

    Not a task itself: a worker it starts holds a paid-worker slot for its life, and a slot
    taken inside a task run is let go when the task ends; `show_profile` records the
    result as the run's `profile` task."""
    try:
        prof = _profile(ctx)
    except RuntimeError as exc:  # the profiling worker died or hung: once more, on a new one
        print(f"zooid: profiling failed ({exc}); once more on a new worker")
        prof = _profile(ctx)
    show_profile(prof)
    return prof


@task(name="profile", cache_policy=NO_CACHE, **task_options(retries=0, timeout_s=60))
def show_profile(prof: dict) -> dict:
    """Where the profile was taken and what it says (the UI's view of the profile step)."""
    keys = ("device", "device_name", "threads", "torch", "profile_sources", "profile_s", "step_s", "param_bytes",
            "peak_memory_bytes", "store_bandwidth_bytes_per_s", "store_latency_s", "checkpoint_s")
    return {k: prof.get(k) for k in keys}

"""Profiling on the target: the model and the store, measured where the workers run, and cached.

The coordinator never times a model whose workers run elsewhere: a worker on the target
measures it (`profiling.profile_job`), on its device and at its thread count, with the store
seen from where it runs. Those are the run's warm workers, rank 0 measuring the model while
rank 1 probes the store (both paid anyway while the plan waits on them; one worker does both
in turn where the run has one), or, for a cold run or a dry run, a one-off worker on the same
pool and offer, stopped once it answered (and billed).

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

import functools
import re
import statistics
import time
from datetime import UTC, datetime

from blocks.store_block import BLOCK_PREFIX
from blocks.store_refs import load_store_block
from coordinator.plan.profile_cache import ProfileCache, model_key, store_key, target_key
from coordinator.plan.run_terms import KEEP, load_terms, timings_key
from coordinator.run.context import RunContext
from coordinator.workers.launchers import worker_threads
from coordinator.workers.warm_pool import WarmPool, provisional_plan
from core.errors import ZooidValueError
from core.keys import probe_prefix, warm_prefix
from core.kinds import Strategy, TargetKind
from core.stage_memory import optimizer_copies
from engine.models import resolve_model
from planners.catalog import device_figures, store_figures
from planners.strategy import job_microbatches
from profiling.estimate import DeviceFigures, estimate_profile
from profiling.profile_job import ProfileRequest

STORE_PROBE_TTL_S = 24 * 3600.0


def microbatch_size(job) -> int:
    """Rows per micro-batch of a pipeline of this job (the planner's default split)."""
    return max(1, job.batch_size // job_microbatches(job.batch_size, job.microbatches))


def may_pipeline(job) -> bool:
    """Whether a pipeline may be planned for `job`: its store probe then also measures the
    compute slowdown under transfers, and is cached under a key of its own."""
    return job.strategy != Strategy.LOCAL_SGD


def probe_key(ctx: RunContext, mkey: str) -> str:
    """The store probe's cache key for `ctx`'s job and model key `mkey`."""
    return store_key(mkey, ctx.store_ref, may_pipeline(ctx.job))


def profile_threads(ctx: RunContext) -> int:
    """Torch threads the profiling worker runs: those of a worker of the job's first plan."""
    return worker_threads(ctx.resolved.target.kind, provisional_plan(ctx))


def profile_request(ctx: RunContext, *, model_profile: bool, store_probe: bool) -> ProfileRequest:
    """What the target's worker is asked to measure: the model, the store, or both (the store
    probe's sizes follow from the model, on the worker: `profiling.store_probe.probe_sizes`)."""
    job, r = ctx.job, ctx.resolved
    return ProfileRequest(
        model=job.model, input_shape=tuple(r.input_shape), classes=r.classes, batch_size=job.batch_size,
        model_kwargs=dict(r.model_kwargs), input_dtype=r.input_dtype, target_shape=tuple(r.target_shape),
        target_dtype=r.target_dtype, loss=job.loss or "",
        microbatch_size=microbatch_size(job), optimizer=job.optimizer, lr=job.lr, seed=job.seed,
        threads=profile_threads(ctx),
        device="cuda" if r.target.worker_gpu > 0 else "auto", model_profile=model_profile,
        store_url=ctx.store_ref if store_probe else "", probe_prefix=probe_prefix(ctx.run_id),
        pipeline=may_pipeline(job))


def check_device(identity: dict, worker_gpu: int) -> None:
    """A job whose workers have GPUs is never planned from a CPU profile."""
    if worker_gpu > 0 and identity.get("device") != "cuda":
        raise ZooidValueError("worker_gpu", f"the target's workers have {worker_gpu} GPU(s) but the profile was "
                                            f"taken on {identity.get('device')} ({identity.get('device_name')}); "
                                            "a GPU job is planned only from a profile taken on its GPU")


class TargetProfiler:
    """Sends profile requests to workers on the target: the run's warm workers, or one one-off
    worker on the same pool and offer, started at the first request and stopped (its keys
    deleted, its time billed like any worker's, an inline worker's fork server ended with it)
    when the profile step ends."""

    def __init__(self, ctx: RunContext):
        self.ctx, self.one_off = ctx, None

    def _pool(self) -> WarmPool:
        if self.ctx.state.warm is not None:
            return self.ctx.state.warm
        self.one_off = self.one_off or WarmPool(self.ctx)
        return self.one_off

    def measure(self, model: bool, store: bool) -> tuple[dict | None, dict | None]:
        """The answers to a model profile and a store probe (each None where not asked for): on
        two workers at once where the pool has two (a warm run's others wait, paid, for the
        plan meanwhile), else both on one worker, one after the other."""
        ctx, pool = self.ctx, self._pool()
        if model and store and pool.profilers() >= 2:
            requests = [profile_request(ctx, model_profile=True, store_probe=False),
                        profile_request(ctx, model_profile=False, store_probe=True)]
        else:
            requests = [profile_request(ctx, model_profile=model, store_probe=store)]
        answers = pool.profile(provisional_plan(ctx), [r.to_dict() for r in requests], ctx.job.worker_timeout_s)
        by_what = {}
        for answer in answers:
            by_what.update({what: answer for what in ("model", "store") if what in answer})
        return by_what.get("model"), by_what.get("store")

    def close(self) -> None:
        if self.one_off is not None:
            self.one_off.stop_all("the profile is taken")
            if self.ctx.state.forks is not None:  # the one-off's fork server: the step leaves nothing running
                self.ctx.state.forks.close()
            store = self.ctx.open_channel()  # the warm channel's store (`RunContext.channel_ref`)
            try:
                store.delete_prefix(warm_prefix(self.ctx.run_id) + "/")
            finally:
                store.close()
            self.one_off = None


def _lookup(ctx: RunContext, cache: ProfileCache, tkey: str, store_max_age_s: float | None = STORE_PROBE_TTL_S):
    """What the cache holds for `ctx`'s job on the target of key `tkey`: (identity, model profile,
    store probe), each None where absent (the store probe also when older than `store_max_age_s`)."""
    job = ctx.job
    identity = cache.target_identity(tkey)
    prof = store = None
    if identity is not None:
        mkey = model_key(ctx, identity, microbatch_size(job))
        prof = cache.get("profiles", mkey)
        store = cache.get("stores", probe_key(ctx, mkey), max_age_s=store_max_age_s)
    return identity, prof, store


def _assemble(identity: dict, prof: dict, store: dict, sources: dict, began: float) -> dict:
    """The profile the planner reads: the model's, the store probe's figures and where they were taken."""
    out = dict(prof)
    out.update(identity=identity, device=identity["device"], device_name=identity["device_name"],
               threads=identity["threads"], torch=identity["torch"],
               store_bandwidth_bytes_per_s=store["bandwidth_bytes_per_s"], store_latency_s=store["latency_s"],
               store_transfer=store["transfer"], checkpoint_s=store["checkpoint_s"],
               synced_step_s=store["synced_step_s"], contention=store["contention"],
               profile_sources=sources, profile_s=time.perf_counter() - began)
    return out


def _profile(ctx: RunContext) -> dict:
    """The model profile and store probe for `ctx`'s job, from the cache where it has them."""
    began = time.perf_counter()
    job, target = ctx.job, ctx.resolved.target
    cache = ProfileCache(ctx.open_durable)
    tkey = target_key(ctx, profile_threads(ctx))
    identity, prof, store = _lookup(ctx, cache, tkey)
    if identity is not None:
        mkey = model_key(ctx, identity, microbatch_size(job))
    target_profiler = TargetProfiler(ctx)
    sources, seconds = {"model": "cache", "store": "cache"}, {}
    try:
        if prof is None or store is None:  # a new model's store probe is new too (its key names the model)
            model_answer, store_answer = target_profiler.measure(model=prof is None, store=True)
            if model_answer is not None:
                identity = model_answer["identity"]
                check_device(identity, target.worker_gpu)
                cache.put_target_identity(tkey, identity)
                mkey = model_key(ctx, identity, microbatch_size(job))
                prof, sources["model"], seconds["model_s"] = model_answer["model"], "measured", model_answer["model_s"]
                cache.put("profiles", mkey, prof)
            store, sources["store"], seconds["store_s"] = store_answer["store"], "measured", store_answer["store_s"]
            cache.put("stores", probe_key(ctx, mkey), store)
    finally:
        target_profiler.close()
    check_device(identity, target.worker_gpu)
    out = _assemble(identity, prof, store, sources, began)
    if seconds:
        _record_profile_seconds(ctx, out["profile_s"])
    measured = ", ".join(f"{k} {'measured in ' + format(seconds[k + '_s'], '.1f') + ' s' if v == 'measured' else 'from the cache'}"
                         for k, v in sources.items())
    print(f"zooid profile of {job.model} on {identity['device']} ({identity['device_name']}, "
          f"{identity['threads']} thread(s), torch {identity['torch']}): {measured}; "
          f"{out['profile_s']:.1f} s in all")
    return out


UNFIXABLE_ERRORS = frozenset({"ZooidValueError", "PlannerInputError", "ValueError", "TypeError", "IndexError",
                              "AttributeError", "ImportError", "ModuleNotFoundError", "NotImplementedError"})
"""Exceptions a profiling worker reports that a second worker would raise again: bad input."""


SHAPE_ERROR = re.compile(r"shapes cannot be multiplied|size mismatch|must match the size|expected input|"
                         r"Expected \d+D|to have \d+ channels|same reduction dim|unflatten|out of bounds|"
                         r"dimension out of range|Given groups=|is invalid for input of size", re.IGNORECASE)
"""A `RuntimeError` from torch that says the model does not take the data it was given."""


def unfixable_reason(exc: BaseException) -> str | None:
    """`ErrorType: first line` when the profiling worker failed for a reason no retry can fix
    (the model does not take the data, bad input); None when a new worker may succeed (it died,
    hung, or the store failed)."""
    match = re.search(r"failed: (\w+): (.*)", str(exc), re.DOTALL)
    if match is None:
        return None
    kind, lines = match.group(1), match.group(2).strip().splitlines()
    first = lines[0].strip() if lines else ""
    if kind in UNFIXABLE_ERRORS or (kind == "RuntimeError" and SHAPE_ERROR.search(first)):
        return f"{kind}: {first}".rstrip(": ")
    return None


def measure_profile(ctx: RunContext) -> dict:
    """Profile the job's model and store on the target (this module's docs).

    A worker that died or hung is replaced once; a failure no retry can fix (`unfixable_reason`:
    the model does not take the data, bad input) stops at once, as a `ZooidValueError` of one
    line, with no second worker rented.

    Not inside a task: a worker it starts holds a paid-worker slot for its life, and a slot
    taken inside a task run is let go when the task ends (`tasks.profile`)."""
    try:
        prof = _profile(ctx)
    except RuntimeError as exc:  # the profiling worker died or hung: once more, on a new one
        reason = unfixable_reason(exc)
        if reason is not None:
            raise _unfixable(ctx, reason) from None
        print(f"zooid: profiling failed ({exc}); once more on a new worker")
        prof = _profile(ctx)
    return prof


def _unfixable(ctx: RunContext, reason: str) -> ZooidValueError:
    """The one line of a profiling failure no retry fixes, naming the field at fault."""
    job, r = ctx.job, ctx.resolved
    data = f"dataset {job.dataset} (a sample is {'x'.join(map(str, r.input_shape))}, {r.classes} classes)"
    kind, _, message = reason.partition(": ")
    field, sep, rest = message.partition(": ")
    if kind in ("ZooidValueError", "PlannerInputError") and sep and " " not in field:
        return ZooidValueError(field, f"{rest} (found by the profiling worker, {job.model} on {data}; "
                                      "not retried, no second worker rented)")
    return ZooidValueError("model", f"{job.model} failed on the profiling worker with {data}: {reason}; "
                                    "not retried (no retry can fix it), no second worker rented")


PROFILE_ASSUMED_S = {TargetKind.INLINE: 6.0, TargetKind.PROCESS: 8.0, "cloud": 20.0}
"""Seconds a worker takes to profile a model and probe the store (after its start-up), until
this target and offer measured one."""


def _record_profile_seconds(ctx: RunContext, seconds: float) -> None:
    """Add a measured profile's seconds to the target's samples (best effort, like the run terms)."""
    try:
        cache = ProfileCache(ctx.open_durable)
        doc = cache.get("profile_times", timings_key(ctx)) or {}
        cache.put("profile_times", timings_key(ctx), {"profile_s": (list(doc.get("profile_s") or []) + [seconds])[-KEEP:]})
    except Exception as exc:
        print(f"zooid: could not cache the profile's time: {type(exc).__name__}: {exc}")


def profile_estimate(ctx: RunContext) -> dict:
    """What renting one worker on the target to take the profile is predicted to cost: the
    offer's price per second x (start-up + profile + stop), each the median this target and
    offer measured before (`coordinator.plan.run_terms`), else assumed. An estimate: the bill is measured."""
    terms = load_terms(ctx)
    samples = (ProfileCache(ctx.open_durable).get("profile_times", timings_key(ctx)) or {}).get("profile_s") or []
    kind = ctx.resolved.target.kind
    profile_s = statistics.median(samples) if samples else PROFILE_ASSUMED_S.get(kind, PROFILE_ASSUMED_S["cloud"])
    seconds = terms.startup_s + profile_s + terms.stop_s
    price = ctx.price_per_worker_s
    return {"startup_s": terms.startup_s, "profile_s": profile_s, "stop_s": terms.stop_s, "seconds": seconds,
            "price_per_s": price, "usd": price * seconds,
            "measured": {"startup_s": bool(terms.measured.get("startup_s")), "profile_s": bool(samples),
                         "stop_s": bool(terms.measured.get("stop_s"))}}


def will_rent(ctx: RunContext) -> bool:
    """Whether `profile(ctx)` starts a worker: the cache lacks this target's profile of the
    job's model or a store probe younger than a day."""
    cache = ProfileCache(ctx.open_durable)
    _, prof, store = _lookup(ctx, cache, target_key(ctx, profile_threads(ctx)))
    return prof is None or store is None


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M UTC")


def cached_profile(ctx: RunContext) -> tuple[dict, str]:
    """The job's profile from the cache, renting nothing (the dry run's `rent=false`): taken on
    this target's workers if it was (its store probe however old), else on another target's
    workers of the same device class (`cuda` for a target with GPUs, else `cpu`), newest first.
    Returns the profile and one line saying where and when it was taken and how far to trust the
    plan; with none cached, the catalog's estimate (`catalog_profile`)."""
    began = time.perf_counter()
    job, target = ctx.job, ctx.resolved.target
    device = "cuda" if target.worker_gpu > 0 else "cpu"
    own = target_key(ctx, profile_threads(ctx))
    cache = ProfileCache(ctx.open_durable)
    candidates = []
    for key in cache.keys("targets"):
        identity, at = cache.get_dated("targets", key)
        if identity and (key == own or identity.get("device") == device):
            candidates.append((key != own, -at, identity))  # this target's own first, then the newest
    for other, _, identity in sorted(candidates, key=lambda c: c[:2]):
        mkey = model_key(ctx, identity, microbatch_size(job))
        prof, prof_at = cache.get_dated("profiles", mkey)
        probe, probe_at = cache.get_dated("stores", probe_key(ctx, mkey))
        if prof is None or probe is None:
            continue
        check_device(identity, target.worker_gpu)
        out = _assemble(identity, prof, probe, {"model": "cache", "store": "cache"}, began)
        age_h = (time.time() - probe_at) / 3600
        trust = ("on this target's own workers: epoch times as good as a fresh profile's" if not other else
                 f"on another target's {identity['device']} workers ({identity['threads']} thread(s)), not this "
                 f"target's ({profile_threads(ctx)} thread(s)): epoch times are uncertain by the "
                 "difference between the two machines, until the first epoch calibrates them")
        note = (f"zooid dry run: planned from a cached profile of {job.model} on {identity['device']} "
                f"({identity['device_name']}, torch {identity['torch']}) taken {_when(prof_at)}, {trust}; "
                f"store figures from {_when(probe_at)}" + (f" ({age_h:.0f} h old: the store's speed may have "
                                                             "drifted)" if age_h > STORE_PROBE_TTL_S / 3600 else "")
                + "; nothing rented")
        return out, note
    return catalog_profile(ctx)


ESTIMATE_SPREAD = "0.5x to 2x"
"""How far a catalog estimate's step time landed from a measured profile on this project's registry
models (digits_mlp, digits_cnn, resnet18, vgg11 on one CPU vCPU: 0.8x to 1.9x)."""


def catalog_profile(ctx: RunContext) -> tuple[dict, str]:
    """The job's profile estimated from the catalog's figures, renting and running nothing
    (`profiling.estimate`: the model's flops and bytes traced on `meta`, at the target device's
    assumed rates; the store's assumed bandwidth and latency for its kind). Returns the profile
    and one line saying what it rests on and how uncertain the plan is. Never cached: the
    first measured profile replaces it."""
    from urllib.parse import urlsplit

    import torch

    began = time.perf_counter()
    job, r = ctx.job, ctx.resolved
    threads = profile_threads(ctx)
    gpu_type = r.offer.gpu_type if r.target.worker_gpu > 0 else None
    try:
        fig = device_figures(gpu_type, threads)
    except ValueError as exc:
        raise ZooidValueError("rent", f"is false, no profile of {job.model} is cached and {exc}") from None
    figures = DeviceFigures(**{k: fig[k] for k in DeviceFigures.__dataclass_fields__})
    factory = functools.partial(resolve_model(job.model), **r.model_kwargs)  # the dataset's vocabulary
    prof = estimate_profile(factory, job.model, tuple(r.input_shape), job.batch_size,
                            microbatch_size(job), job.optimizer, optimizer_copies(job.optimizer), figures,
                            threads, input_dtype=r.input_dtype, target_shape=tuple(r.target_shape),
                            gpu=bool(gpu_type), target_dtype=r.target_dtype, loss=job.loss).to_dict()
    ref = ctx.store_ref
    scheme = urlsplit(load_store_block(ref).url() if ref.startswith(BLOCK_PREFIX) else ref).scheme
    medium = store_figures(scheme, r.offer.network_bytes_per_s)
    device = "cuda" if gpu_type else "cpu"
    what = f"a {gpu_type} GPU" if gpu_type else f"{threads} CPU vCPU{'s' if threads > 1 else ''}"
    identity = {"device": device, "device_name": f"catalog figures for {what}", "threads": threads,
                "torch": torch.__version__, "hardware": "catalog estimate"}
    store = {"bandwidth_bytes_per_s": medium["bandwidth_bytes_per_s"], "latency_s": medium["latency_s"],
             "transfer": None, "checkpoint_s": None, "synced_step_s": None, "contention": 1.0}
    out = _assemble(identity, prof, store, {"model": "catalog", "store": "catalog"}, began)
    note = (f"zooid dry run: no profile of {job.model} (this batch and optimizer) is cached for a {device} worker, "
            f"so it is planned from the catalog's figures: per-layer times from the model's flops and bytes at "
            f"{what}'s assumed rates ({fig['flops_per_s']:.3g} FLOP/s, {fig['bytes_per_s']:.3g} B/s), the "
            f"{scheme} store at an assumed {medium['bandwidth_bytes_per_s']:.3g} B/s and "
            f"{medium['latency_s'] * 1e3:.3g} ms. Uncertain: such estimates landed at {ESTIMATE_SPREAD} of a "
            "measured profile, so the epoch time and the bill may be off by as much; the first epoch of a run "
            "calibrates them, and rent=true measures them now; nothing rented")
    return out, note

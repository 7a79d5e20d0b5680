"""The `profile` step: measure the model on this hardware and the store it will sync through.

The model profile is cached by Prefect, keyed on model, input shape, batch size and hardware,
so a second run of the same job does not profile again; the store probe is cheap and always
measured, since a store's speed depends on where it is.
"""
from __future__ import annotations

import hashlib
import json

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RunContext
from tasks.retry import task_options


def _profile_cache_key(context, params) -> str:
    from training.profiler import hardware_fingerprint

    key = {k: params[k] for k in ("model", "input_shape", "classes", "batch_size", "optimizer")}
    key["hardware"] = hardware_fingerprint(threads=1)  # the task profiles at one thread
    key["version"] = 2
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
def probe_store(ctx: RunContext) -> dict:
    """The store's fitted bandwidth (bytes/s) and latency (s)."""
    from training.profiler import profile_store

    store = ctx.open_store()
    try:
        bw, lat = profile_store(store, ctx.prefix("probe"))
    finally:
        store.close()
    return {"bandwidth_bytes_per_s": bw, "latency_s": lat}


def profile(ctx: RunContext) -> dict:
    """The profile step: model profile (cached) plus store probe."""
    r = ctx.resolved
    prof = profile_model(ctx.job.model, list(r.input_shape), r.classes, ctx.job.batch_size, ctx.job.seed,
                         ctx.job.optimizer)
    prof = dict(prof)
    prof.update(store_bandwidth_bytes_per_s=None, store_latency_s=None)
    probe = probe_store(ctx)
    prof["store_bandwidth_bytes_per_s"] = probe["bandwidth_bytes_per_s"]
    prof["store_latency_s"] = probe["latency_s"]
    return prof

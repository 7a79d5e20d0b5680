"""The profile cache in the durable store, and the keys that say when a profile holds.

A cached figure is used only where it was measured under the same conditions: the same
model (a registry name, or an import path plus a hash of its module's source, so an edited
model is profiled again), input, batch, optimizer, device name, threads and torch version.
Documents are plain JSON under `cache/` (not under a run: a cache outlives runs) and are
read back as JSON only.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from core.keys import cache_key, cache_prefix
from core.kinds import SHARED_HOST_KINDS
from profiling.profile_job import PROFILE_VERSION


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=list).encode()).hexdigest()[:32]


def model_identity(model: str) -> str:
    """A registry name as it is; `package.module:factory` plus a hash of the module's source."""
    if ":" not in model:
        return model
    module = model.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        with open(origin, "rb") as fh:
            source = fh.read()
    except (ImportError, OSError, TypeError, ValueError):
        source = b""  # not importable here: the worker's own error names it
    return f"{model}@{hashlib.sha256(source).hexdigest()[:16]}"


def target_key(ctx, threads: int) -> str:
    """What a target's workers are, as the coordinator knows them before any starts: the
    target and its launch settings (and this machine, where the workers share it)."""
    t, offer = ctx.resolved.target, ctx.resolved.offer
    doc = {"v": PROFILE_VERSION, "target": ctx.resolved.target_name, "kind": t.kind,
           "image": getattr(t, "image", "") or "", "offer": offer.name, "vcpu": t.worker_vcpu,
           "memory_gb": t.worker_memory_gb, "gpu": t.worker_gpu, "threads": threads,
           "host": socket.gethostname() if t.kind in SHARED_HOST_KINDS else ""}
    return _digest(doc)


def model_key(ctx, identity: dict, microbatch_size: int) -> str:
    """The model profile's key: the model's identity, its input and training settings, and
    the device, threads and torch version it is measured with."""
    job, r = ctx.job, ctx.resolved
    return _digest({"v": PROFILE_VERSION, "model": model_identity(job.model), "input_shape": list(r.input_shape),
                    "classes": r.classes, "batch_size": job.batch_size, "microbatch_size": microbatch_size,
                    "optimizer": job.optimizer, "device": identity["device"],
                    "device_name": identity["device_name"], "threads": identity["threads"],
                    "torch": identity["torch"], **({"model_kwargs": r.model_kwargs} if r.model_kwargs else {}),
                    **({"input_dtype": r.input_dtype, "target_shape": list(r.target_shape)}
                       if r.input_dtype != "float32" or r.target_shape else {}),
                    **({"target_dtype": r.target_dtype, "loss": job.loss} if job.loss else {})})


def store_key(model_key_: str, store_ref: str, pipeline: bool) -> str:
    """The store probe's key: the model it timed checkpoints of, where the store is (hashed:
    a URL may hold a password), and whether a pipeline's transfers were probed too."""
    parts = urlsplit(store_ref)
    return _digest({"model": model_key_, "where": f"{parts.scheme}://{parts.netloc}", "pipeline": pipeline})


class ProfileCache:
    """JSON documents under `cache/` of a store opened by `open_store()` (a fresh client per call)."""

    def __init__(self, open_store: Callable[[], Any]):
        self.open_store = open_store

    def get(self, kind: str, key: str, max_age_s: float | None = None) -> dict | None:
        """The cached `value` under `kind/key`, or None when absent or older than `max_age_s`."""
        value, measured_at = self.get_dated(kind, key)
        if max_age_s is not None and time.time() - measured_at > max_age_s:
            return None
        return value

    def get_dated(self, kind: str, key: str) -> tuple[dict | None, float]:
        """The cached `value` under `kind/key` (None when absent) and when it was measured
        (seconds since the epoch; 0 when absent)."""
        store = self.open_store()
        try:
            doc = json.loads(store.get(cache_key(kind, key)))
        except (KeyError, ValueError):
            return None, 0.0
        finally:
            store.close()
        return doc.get("value"), float(doc.get("measured_at") or 0.0)

    def keys(self, kind: str) -> list[str]:
        """The keys cached under `kind`."""
        prefix = cache_prefix(kind)
        store = self.open_store()
        try:
            return [k[len(prefix):-len(".json")] for k in store.list(prefix) if k.endswith(".json")]
        finally:
            store.close()

    def put(self, kind: str, key: str, value: dict) -> None:
        store = self.open_store()
        try:
            store.put(cache_key(kind, key), json.dumps({"measured_at": time.time(), "value": value}).encode())
        finally:
            store.close()

    def target_identity(self, key: str) -> dict | None:
        return self.get("targets", key)

    def put_target_identity(self, key: str, identity: dict) -> None:
        self.put("targets", key, identity)

"""Profiling on the target: what a worker measures when the coordinator asks for a profile.

The coordinator never times a model whose workers run elsewhere. It sends a
`ProfileRequest` to a worker on the target (a warm worker, or a one-off worker on the same
pool and offer, `coordinator.plan.target_profile`), which measures, on its own device and at its
own thread count (a warm run with two workers or more has one measure the model while
another probes the store):

- the model (`profiling.profiler.profile_model`): per-layer and whole-step times, bytes and
  peak memory, each timing sampled until it is stable;
- the store, from where the worker runs (`profiling.store_probe.probe_store_side`): put and get
  costs by size, the hand-off delay, the sync checkpoint write and, for a pipeline, the
  compute slowdown while transfers run.

The answer (`run_profile`) names what it was taken with: device type and name, threads,
torch version and the hardware fingerprint, so a cached profile is used only where it holds.
"""
from __future__ import annotations

import dataclasses
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from core.errors import ZooidValueError
from engine.models import build_model
from engine.optimizers import build_optimizer
from profiling.profiler import hardware_fingerprint, profile_model
from profiling.sample import sample_batch
from profiling.store_probe import probe_sizes, probe_store_side

PROFILE_VERSION = 6
"""Bumped whenever what a profile measures changes (part of every cache key)."""


@dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """What to profile, sent as the `request` of a warm worker's `profile` command."""

    model: str
    input_shape: tuple[int, ...]
    classes: int
    batch_size: int
    microbatch_size: int
    optimizer: str = "sgd"
    lr: float = 0.05
    seed: int = 0
    threads: int = 1
    device: str = "auto"
    """`cuda`, `cpu`, or `auto` (CUDA where the worker has it)."""
    model_profile: bool = True
    """Measure the model (False: only the store, the model came from the cache)."""
    store_url: str = ""
    """The run's store, probed from the worker (empty: no store probe)."""
    probe_prefix: str = ""
    pipeline: bool = False
    """A pipeline may be planned: the store probe also measures compute under transfers of a
    typical activation (its sizes follow from the model, `probe_sizes`)."""
    input_dtype: str = "float32"
    """The data's inputs: `float32` rows or `int64` token ids (`profiling.sample`)."""
    target_shape: tuple[int, ...] = ()
    """Targets per sample: () for class labels, (T,) for a token per position."""
    target_dtype: str = "int64"
    """`int64` labels or token ids, `float32` values (a custom loss's)."""
    loss: str = ""
    """The job's custom loss (`package.module:function`); empty: the default cross-entropy."""
    model_kwargs: dict = dataclasses.field(default_factory=dict)
    """The model factory's arguments the dataset decides (`ResolvedJob.model_kwargs`)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProfileRequest":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ZooidValueError("request", f"unknown profile request fields {unknown}")
        return cls(**{**d, "input_shape": tuple(d["input_shape"]),
                      "target_shape": tuple(d.get("target_shape", ()))})


def pick_device(wanted: str) -> torch.device:
    """The device a worker profiles on: the one it trains on."""
    if wanted not in ("auto", "cuda", "cpu"):
        raise ZooidValueError("device", f"must be auto, cuda or cpu, got {wanted!r}")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ZooidValueError("device", "CUDA was asked for but this worker has no GPU")
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(wanted)


def device_identity(device: torch.device, threads: int) -> dict[str, Any]:
    """Where a profile was taken: device type and name, threads, torch version, hardware."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    return {"device": device.type, "device_name": name, "threads": threads, "torch": torch.__version__,
            "hardware": hardware_fingerprint(threads)}


def run_profile(request: ProfileRequest, open_store: Callable[[str], Any], base_memory_bytes: int = 0) -> dict:
    """Measure what `request` asks for on this worker; JSON-able. `base_memory_bytes` is the
    worker's resident memory before it built any model (s0 of the memory model)."""
    began = time.perf_counter()
    torch.set_num_threads(request.threads)
    device = pick_device(request.device)
    out: dict[str, Any] = {"identity": device_identity(device, request.threads), "version": PROFILE_VERSION}
    net = build_model(request.model, request.seed, **request.model_kwargs).to(device)
    if request.model_profile:
        t0 = time.perf_counter()
        prof = profile_model(net, request.model, request.input_shape, request.classes, request.batch_size,
                             repeats=3, microbatch_size=request.microbatch_size, optimizer=request.optimizer,
                             base_memory=False, thread_counts=[request.threads], input_dtype=request.input_dtype,
                             target_shape=request.target_shape, target_dtype=request.target_dtype,
                             loss=request.loss or None).to_dict()
        prof["base_memory_bytes"] = base_memory_bytes
        out["model"], out["model_s"] = prof, time.perf_counter() - t0
    if request.store_url:
        t0 = time.perf_counter()
        x, y = sample_batch(request.input_shape, request.classes, request.batch_size,
                            generator=torch.Generator().manual_seed(request.seed), input_dtype=request.input_dtype,
                            target_shape=request.target_shape, target_dtype=request.target_dtype, device=device)
        max_bytes, activation_bytes = probe_sizes(net, x[:request.microbatch_size], request.optimizer,
                                                  request.pipeline)
        store = open_store(request.store_url)
        try:
            out["store"] = probe_store_side(
                store, request.probe_prefix, net, build_optimizer(request.optimizer, net, request.lr), x, y,
                request.classes, max_bytes=max_bytes, microbatch_size=request.microbatch_size,
                activation_bytes=activation_bytes, loss=request.loss or None)
        finally:
            store.close()
        out["store_s"] = time.perf_counter() - t0
    out["seconds"] = time.perf_counter() - began
    return out

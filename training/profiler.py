"""Profile a model on the hardware it will train on, and the store it will sync through.

Per top-level layer: forward and backward seconds per micro-batch (median of repeats after
warm-up), output bytes, parameter bytes. Whole model: one optimizer step's seconds at the
job's batch size, parameter bytes, peak resident memory. Store: timed puts and gets of
several sizes fitted to `bytes / bandwidth + latency`.
"""
from __future__ import annotations

import dataclasses
import platform
import resource
import statistics
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Measured figures of one top-level layer for one micro-batch."""

    name: str
    forward_s: float
    backward_s: float
    output_bytes: int
    param_bytes: int


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What the planners need to know about a model on this hardware."""

    model: str
    input_shape: tuple[int, ...]
    batch_size: int
    step_s: float
    """Seconds for one forward + backward + optimizer step at `batch_size`."""
    param_bytes: int
    peak_rss_bytes: int
    layers: tuple[LayerProfile, ...] = ()
    store_bandwidth_bytes_per_s: float = 1e9
    store_latency_s: float = 1e-3
    hardware: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelProfile":
        d = dict(d)
        d["input_shape"] = tuple(d["input_shape"])
        d["layers"] = tuple(LayerProfile(**layer) for layer in d.get("layers", ()))
        return cls(**d)


def hardware_fingerprint() -> str:
    """A short string naming the hardware a profile is valid for (part of the cache key)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return f"{platform.machine()}/{platform.processor() or 'cpu'}/{torch.get_num_threads()}t/{gpu}"


def _median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def profile_model(model: nn.Module, name: str, input_shape: tuple[int, ...], num_classes: int,
                  batch_size: int, repeats: int = 5) -> ModelProfile:
    """Time one training step and each top-level layer on synthetic input of `input_shape`."""
    model.train()
    x = torch.randn(batch_size, *input_shape)
    y = torch.randint(0, num_classes, (batch_size,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    step_s = _median_time(step, repeats)
    layers = []
    children = list(model.named_children()) if isinstance(model, nn.Sequential) else []
    h = x
    for lname, layer in children:
        inp = h.detach().requires_grad_(True)
        out = layer(inp)
        fwd = _median_time(lambda: layer(inp), repeats)
        grad = torch.ones_like(out)

        def backward():
            o = layer(inp)
            o.backward(grad)

        bwd = max(0.0, _median_time(backward, repeats) - fwd)
        layers.append(LayerProfile(name=lname, forward_s=fwd, backward_s=bwd,
                                   output_bytes=out.numel() * out.element_size(),
                                   param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters())))
        h = out.detach()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return ModelProfile(model=name, input_shape=tuple(input_shape), batch_size=batch_size,
                        step_s=step_s, param_bytes=param_bytes, peak_rss_bytes=peak,
                        layers=tuple(layers), hardware=hardware_fingerprint())


def profile_store(store, run_prefix: str, sizes: tuple[int, ...] = (64 << 10, 1 << 20, 4 << 20),
                  repeats: int = 3) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of `store`, fitted by least squares to timed put+get
    round trips under `run_prefix` (deleted afterwards). One transfer = half a round trip."""
    rows, times = [], []
    key_base = f"{run_prefix}/probe-{uuid.uuid4().hex[:8]}"
    try:
        for size in sizes:
            payload = np.random.default_rng(size).bytes(size)
            for i in range(repeats):
                key = f"{key_base}/{size}-{i}"
                t0 = time.perf_counter()
                store.put(key, payload)
                store.get(key)
                times.append((time.perf_counter() - t0) / 2)
                rows.append((size, 1.0))
    finally:
        store.delete_prefix(key_base)
    a = np.array(rows, dtype=float)
    coef, *_ = np.linalg.lstsq(a, np.array(times), rcond=None)
    per_byte, latency = float(coef[0]), float(coef[1])
    bandwidth = 1.0 / per_byte if per_byte > 0 else 1e12
    return bandwidth, max(latency, 1e-6)

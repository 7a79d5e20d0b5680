"""Profile a model on the hardware it will train on, and the links it will sync through.

What the planners need, measured rather than guessed (`profile_model` -> `ModelProfile`):

- per top-level layer: forward and backward seconds per micro-batch, output, activation
  and parameter bytes (`profiling.timing.profile_layers`);
- whole model: one optimizer step's seconds at the job's batch size, forward and backward
  seconds per micro-batch, peak memory of a training step (see
  `profiling.memory.measure_peak_memory` for what is counted on CPU and on CUDA), the base
  memory s0 of a fresh worker process (`profiling.memory.measure_base_memory`);
- how step time scales with vCPUs (`profiling.timing.measure_thread_scaling`), so per-offer
  timings can be scaled to an offer's vCPU count (`ModelProfile.step_s_at`);
- the links (store, contention, collectives) live in `profiling.store_probe`.

`to_planner_layers` turns a profile into the `layers` list of the planners' JSON contract
(PLANNER_SPEC.md). Profiling leaves the model's weights and buffers as it found them.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import platform
import resource
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from core.errors import ZooidValueError
from engine.malloc import pin_malloc_thresholds
from engine.optimizers import build_optimizer
from profiling.memory import (_param_bytes, _training_step, loss_memory_bytes, measure_activation_bytes,
                              measure_base_memory, measure_peak_memory)
from profiling.sample import profile_loss, sample_batch
from profiling.timing import (ANCHOR_MIN_S, LayerProfile, _median_time, cpu_count, fit_serial_fraction,
                              measure_thread_scaling, profile_layers, vcpu_factor)


# --- the data ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What the planners need to know about a model on this hardware."""

    model: str
    input_shape: tuple[int, ...]
    batch_size: int
    input_dtype: str = "float32"
    """`float32` rows, or `int64` token ids ([B, T]: `input_shape` is (T,)); `profiling.sample`."""
    target_shape: tuple[int, ...] = ()
    """Targets per sample: () for a class label, (T,) for a token per position."""
    step_s: float
    """Seconds for one forward + backward + optimizer step at `batch_size`."""
    param_bytes: int
    peak_rss_bytes: int
    optimizer_step_s: float = 0.0
    """Seconds of the optimizer's step alone, for the whole model (a pipeline stage pays its
    share of the parameters)."""
    """Peak resident memory of the profiling process so far (ru_maxrss)."""
    layers: tuple[LayerProfile, ...] = ()
    store_bandwidth_bytes_per_s: float = 1e9
    store_latency_s: float = 1e-3
    hardware: str = ""
    extra: dict = field(default_factory=dict)
    microbatch_size: int = 0
    """Samples per micro-batch the layer figures are for (0: same as `batch_size`)."""
    forward_s: float = 0.0
    """Whole-model forward seconds per micro-batch (loss included)."""
    backward_s: float = 0.0
    """Whole-model backward seconds per micro-batch."""
    activation_bytes: int = 0
    """Bytes the whole model keeps for backward at `batch_size` (each tensor once)."""
    optimizer: str = "sgd"
    optimizer_state_bytes: int = 0
    peak_memory_bytes: int = 0
    """Peak memory of one training step at `batch_size`; `peak_memory_method` says how."""
    peak_memory_method: str = ""
    rss_growth_bytes: int = 0
    """Growth of the process's peak RSS over one training step after earlier ones (CPU;
    0 where unreadable, and often 0 anyway: a later step reuses memory already resident)."""
    base_memory_bytes: int = 0
    """s0: RSS of a fresh Python process after importing torch and the model's module."""
    threads: int = 0
    """torch threads the layer and step figures were measured with."""
    step_s_by_threads: dict = field(default_factory=dict)
    """Step seconds at `batch_size` by thread count (keys are strings, for JSON)."""
    serial_fraction: float = 1.0
    """Amdahl serial fraction of a step, fitted from `step_s_by_threads` (1.0: unmeasured)."""
    contention: float = 1.0
    """beta >= 1: compute slowdown while transfers run (1.0 until the links are profiled)."""
    allreduce_alpha_s_per_byte: float = 0.0
    """The hybrid contract's ring allreduce alpha (seconds per byte beyond the store's
    bandwidth), fitted to the store allreduce timed among worker processes (0.0: not timed,
    a job of one worker)."""
    allreduce_beta_s: float = 0.0
    """... and its per-round beta in seconds."""

    def to_dict(self) -> dict:
        """Plain JSON-able dict (Prefect persists it with the JSON serializer)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelProfile":
        """Inverse of `to_dict`; fields this version does not know are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        d["input_shape"] = tuple(d["input_shape"])
        d["target_shape"] = tuple(d.get("target_shape", ()))
        d["layers"] = tuple(LayerProfile(**layer) for layer in d.get("layers", ()))
        return cls(**d)

    def scale_factor(self, vcpu: float) -> float:
        """Seconds on `vcpu` vCPUs per second measured here (`vcpu_factor` ratio)."""
        base = self.threads or 1
        return vcpu_factor(vcpu, self.serial_fraction) / vcpu_factor(base, self.serial_fraction)

    def step_s_at(self, vcpu: float) -> float:
        """`step_s` scaled to a worker of `vcpu` vCPUs (per-offer step time)."""
        return self.step_s * self.scale_factor(vcpu)

    def layer_activation_bytes(self, microbatch_size: int) -> list[int]:
        """Per-layer activation bytes at another micro-batch size: activations are linear
        in the samples, so the measured figures scale by size / `microbatch_size`."""
        measured = self.microbatch_size or self.batch_size
        return [round(layer.activation_bytes * microbatch_size / measured) for layer in self.layers]


def hardware_fingerprint(threads: int | None = None) -> str:
    """A stable string naming the hardware a profile is valid for (part of the cache key):
    machine, CPU model, usable cores, torch threads (`threads`, default the current
    setting), torch version and GPU model and count. Nothing in it changes between runs."""
    cpu_model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(line.split(":", 1)[1].strip() for line in f
                             if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = "nogpu"
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()}x{torch.cuda.get_device_name(0)}"
    threads = torch.get_num_threads() if threads is None else threads
    return (f"{platform.machine()}/{cpu_model}/{cpu_count()}cpu/{threads}t/"
            f"torch{torch.__version__}/{gpu}")


# --- the model side ------------------------------------------------------------------------


def _build_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    # A tiny rate: the weights barely move, and they are restored afterwards anyway.
    return build_optimizer(name, model, 1e-9)


def _model_modules(name: str) -> tuple[str, ...]:
    """The user's modules a worker imports to build model `name` (none for a registry name)."""
    return (name.partition(":")[0],) if ":" in name else ()


def profile_model(model: nn.Module, name: str, input_shape: tuple[int, ...], num_classes: int,
                  batch_size: int, repeats: int = 5, *, microbatch_size: int | None = None,
                  optimizer: str = "sgd", base_memory: bool = True,
                  thread_counts: Sequence[int] | None = None, input_dtype: str = "float32",
                  target_shape: Sequence[int] = (), target_dtype: str = "int64",
                  loss: str | None = None) -> ModelProfile:
    """Profile `model` on synthetic input of `input_shape` on the device its parameters live on.

    The input is what the job's data is (`profiling.sample.sample_batch`): float rows, or with
    `input_dtype` "int64" token ids (a language model's [B, T], T the job's `seq_len`), scored
    against targets of `target_shape` per sample ([T] for tokens; `target_dtype` "float32": a
    custom loss's values) by the job's loss (`loss`, a custom function's import path; None: the
    default cross-entropy).
    Layer and whole-model forward/backward figures are per micro-batch of
    `microbatch_size` samples (default `batch_size`); the step time and peak memory are
    for a full step at `batch_size` with `optimizer`. The last layer's activation bytes
    include what the loss adds at the head (`profiling.memory.loss_memory_bytes`: the
    logits and the log-softmax, [B, T, V] each for a language model). `base_memory=False`
    skips the s0 subprocess; `thread_counts` (default 1 and every core) are where the step
    is timed to fit the vCPU scaling. The model's weights and buffers are restored afterwards."""
    labels_drawn = target_dtype == "int64" or input_dtype == "int64"  # a custom loss's float targets need none
    for label, value in (("batch_size", batch_size), ("repeats", repeats),
                         ("microbatch_size", microbatch_size or 1), ("num_classes", num_classes if labels_drawn else 1)):
        if not isinstance(value, int) or value < 1:
            raise ZooidValueError(label, f"must be a positive integer, got {value!r}")
    micro = microbatch_size or batch_size
    pin_malloc_thresholds()  # as every worker runs (engine.malloc)
    device = next(model.parameters(), torch.empty(0)).device
    saved_state = copy.deepcopy(model.state_dict())
    was_training = model.training
    model.train()
    gen = torch.Generator().manual_seed(0)
    shaped = dict(generator=gen, input_dtype=input_dtype, target_shape=tuple(target_shape), target_dtype=target_dtype,
                  device=device)
    x, y = sample_batch(input_shape, num_classes, batch_size, **shaped)
    xm, ym = x[:micro].clone(), y[:micro].clone()  # storages of their own: a layer keeping its input keeps these
    if micro > batch_size:
        xm, ym = sample_batch(input_shape, num_classes, micro, **shaped)
    try:
        opt = _build_optimizer(optimizer, model)
        step = _training_step(model, opt, x, y, loss)
        threads = torch.get_num_threads()
        # a few more warm-up steps than elsewhere: the allocator and caches settle over the
        # first steps, and a training run is all steady state
        step_s = _median_time(step, 2 * repeats, device, warmup=3, min_time_s=ANCHOR_MIN_S)
        optimizer_step_s = _median_time(opt.step, 2 * repeats, device)  # gradients are in place
        layers = with_loss_memory(profile_layers(model, xm, repeats, fit_rows=max(1, micro // 4)), model, xm, ym,
                                  loss)
        fwd = _median_time(lambda: profile_loss(model(xm), ym, loss), repeats, device)
        bwd = _median_time(lambda value: value.backward(), repeats, device,
                           setup=lambda: profile_loss(model(xm), ym, loss))
        peak, method, growth, state_bytes = measure_peak_memory(model, opt, x, y, loss)
        by_threads = measure_thread_scaling(step, device, max(1, repeats // 2 + 1), thread_counts)
        by_threads.setdefault(threads, step_s)
        activation = measure_activation_bytes(model, x, y, loss)
    finally:
        model.load_state_dict(saved_state)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return ModelProfile(
        model=name, input_shape=tuple(input_shape), input_dtype=input_dtype, target_shape=tuple(target_shape),
        batch_size=batch_size, step_s=step_s, optimizer_step_s=optimizer_step_s,
        param_bytes=_param_bytes(model),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        layers=layers, hardware=hardware_fingerprint(threads), microbatch_size=micro,
        forward_s=fwd, backward_s=bwd, activation_bytes=activation, optimizer=optimizer,
        optimizer_state_bytes=state_bytes, peak_memory_bytes=peak, peak_memory_method=method,
        rss_growth_bytes=growth,
        base_memory_bytes=measure_base_memory(_model_modules(name)) if base_memory else 0,
        threads=threads, step_s_by_threads={str(n): s for n, s in sorted(by_threads.items())},
        serial_fraction=fit_serial_fraction(by_threads))


def with_loss_memory(layers: tuple[LayerProfile, ...], model: nn.Module, x: torch.Tensor,
                     y: torch.Tensor, loss: str | None = None) -> tuple[LayerProfile, ...]:
    """`layers` with the loss's memory on micro-batch (`x`, `y`) added to the last one's
    activation bytes (`profiling.memory.loss_memory_bytes`): the stage holding the head
    holds the logits and the log-softmax too."""
    if not layers:
        return layers
    with torch.no_grad():
        out = model(x)
    last = layers[-1]
    extra = loss_memory_bytes(out, y, loss)
    return (*layers[:-1], dataclasses.replace(last, activation_bytes=last.activation_bytes + extra))


# --- what the planners read ----------------------------------------------------------------


PLANNER_KINDS = ("partition", "hybrid", "co-optimize")


def to_planner_layers(profile: ModelProfile, kind: str = "partition", *,
                      vcpu: float | None = None,
                      vcpus: Sequence[float] | None = None) -> list[dict]:
    """The `layers` list of a planner document (PLANNER_SPEC.md) from `profile`.

    `partition` / `hybrid`: `{name, forward_s, backward_s, output_bytes, param_bytes}`,
    times scaled to `vcpu` vCPUs when given. `co-optimize`: the same with `forward_s` and
    `backward_s` as one entry per memory option, scaled to `vcpus[j]` (default: the
    measured setting only), plus `activation_bytes`. Times are per micro-batch of
    `profile.microbatch_size` samples."""
    if kind not in PLANNER_KINDS:
        raise ZooidValueError("kind", f"unknown planner {kind!r}; valid: {', '.join(PLANNER_KINDS)}")
    if not profile.layers:
        raise ZooidValueError("profile", f"{profile.model!r} has no layer figures to plan with")
    out = []
    if kind == "co-optimize":
        factors = [profile.scale_factor(v) for v in vcpus] if vcpus else [1.0]
        for layer in profile.layers:
            out.append({"name": layer.name,
                        "forward_s": [layer.forward_s * f for f in factors],
                        "backward_s": [layer.backward_s * f for f in factors],
                        "output_bytes": layer.output_bytes,
                        "activation_bytes": layer.activation_bytes,
                        "param_bytes": layer.param_bytes})
        return out
    factor = profile.scale_factor(vcpu) if vcpu is not None else 1.0
    for layer in profile.layers:
        out.append({"name": layer.name, "forward_s": layer.forward_s * factor,
                    "backward_s": layer.backward_s * factor,
                    "output_bytes": layer.output_bytes, "param_bytes": layer.param_bytes})
    return out


def profile_summary(profile: ModelProfile) -> str:
    """One JSON line with the headline figures (for logs and reports)."""
    keys = ("model", "batch_size", "microbatch_size", "step_s", "forward_s", "backward_s",
            "param_bytes", "activation_bytes", "peak_memory_bytes", "peak_memory_method",
            "base_memory_bytes", "serial_fraction", "contention")
    return json.dumps({k: getattr(profile, k) for k in keys})

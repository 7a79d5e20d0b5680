"""Profile a model on the hardware it will train on, and the links it will sync through.

What the planners need, measured rather than guessed:

- per top-level layer (children of an `nn.Sequential`, or of any model whose children run
  in order; other models get one whole-model "layer"): forward and backward seconds per
  micro-batch (median of repeats after warm-up), output bytes, activation bytes (what
  autograd keeps for the backward pass, counted with saved-tensor hooks), parameter bytes;
- whole model: one optimizer step's seconds at the job's batch size, forward and backward
  seconds per micro-batch, peak memory of a training step (see `measure_peak_memory` for
  what is counted on CPU and on CUDA), the base memory s0 of a fresh worker process;
- how step time scales with vCPUs (Amdahl's law fitted to steps at 1 thread and at every
  core; `vcpu_factor`), so per-offer timings can be scaled to an offer's vCPU count;
- the links (store, contention, collectives) live in `profiling.store_probe`.

`to_planner_layers` turns a profile into the `layers` list of the planners' JSON contract
(PLANNER_SPEC.md). Profiling leaves the model's weights and buffers as it found them.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from core.errors import ZooidError, ZooidValueError
from engine.malloc import pin_malloc_thresholds

# --- the data ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Measured figures of one top-level layer for one micro-batch."""

    name: str
    forward_s: float
    backward_s: float
    output_bytes: int
    param_bytes: int
    activation_bytes: int = 0
    """Bytes autograd keeps from this layer's forward until its backward (parameters not
    counted). Each layer is measured on its own input, so a tensor two neighbours both keep
    (a ReLU's output, the next Linear's input) counts in both: per-stage sums err safe."""
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    """Per-call parts of the forward and backward seconds: the intercepts of t(n) = fixed +
    n x per-row through the layer timed at two batch sizes (`_intercept`). A small
    micro-batch pays the fixed part in full (kernel launches, Python, allocation), so times
    do not scale linearly with rows; 0 where only one size was timed."""


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


# --- timing and memory primitives ----------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ANCHOR_MIN_S = 0.3
"""Least seconds of samples behind an anchor time (the whole step, the chain the layers are
scaled to): these machines' speed wanders by 10-25 % from one 0.1 s window to the next, so a
short model's few repeats would catch one window; a median over 0.3 s or more varies by
about 3 % (measured here)."""


STABLE_WITHIN = 0.03
"""Sampling stops once another round of samples moves the median by less than this share."""


def _median_time(fn: Callable[[], object], repeats: int, device: torch.device,
                 warmup: int = 1, setup: Callable[[], object] | None = None,
                 min_time_s: float = 0.0, max_rounds: int = 4) -> float:
    """Median seconds of `fn(setup())` (or `fn()`), after `warmup` untimed calls: `repeats`
    samples, and more while their total is under `min_time_s` (at most 100 x `repeats`);
    then rounds of `repeats` more while a round moves the median by more than
    `STABLE_WITHIN` (at most `max_rounds` rounds): sampling stops when the estimate is stable."""
    samples, total, i = [], 0.0, 0

    def sample() -> None:
        nonlocal total
        arg = setup() if setup else None
        _sync(device)
        t0 = time.perf_counter()
        fn(arg) if setup else fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
        total += samples[-1]

    for _ in range(warmup):
        fn(setup()) if setup else fn()
    while len(samples) < repeats or (total < min_time_s and len(samples) < 100 * repeats):
        sample()
    for _ in range(max_rounds - 1):
        before = statistics.median(samples)
        for _ in range(repeats):
            sample()
        if abs(statistics.median(samples) - before) <= STABLE_WITHIN * before:
            break
    return statistics.median(samples)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _param_bytes(module: nn.Module) -> int:
    return sum(_nbytes(p) for p in module.parameters())


class _SavedTensors:
    """Counts the distinct storages autograd saves for backward while active; parameters
    (and anything else listed in `exclude`) are not activations and are left out."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._exclude and ptr not in self._seen:
            self._seen[ptr] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        """Bytes of the distinct storages saved so far."""
        return sum(self._seen.values())

    def __enter__(self) -> "_SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level children when they run in order, else [("model", model)]."""
    from engine.stages import sequential_children

    try:
        return sequential_children(model)
    except ZooidValueError:
        return [("model", model)]


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; elsewhere the peak, the best there is)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux clear_refs); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_since_reset() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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


def profile_layers(model: nn.Module, x: torch.Tensor, repeats: int = 5,
                   fit_rows: int | None = None, calibrate: bool = True) -> tuple[LayerProfile, ...]:
    """Per top-level layer: forward and backward seconds on micro-batch `x`, output,
    activation and parameter bytes. Each layer runs on a detached copy of its input
    (requiring grad after the first layer, as a pipeline stage's input does); backward is
    timed on its own, after an untimed forward, with a gradient of ones. With `fit_rows`
    (fewer rows than `x` has), each layer is timed again on its input's first `fit_rows`
    rows and the per-call part of its times fitted (`LayerProfile.forward_fixed_s`).

    `calibrate`: a layer timed alone, repeatedly, finds its weights and activations in the
    caches, which a pass through the whole chain does not (measured here: the chain is 4 to
    36 % slower than the sum of its layers). So the chain is timed too, at each size, and
    the layers' forward (backward) times scaled by chain / sum, which keeps their shares."""
    rows = len(x)
    small = fit_rows if fit_rows is not None and 0 < fit_rows < rows else None
    children = _children(model)
    layers, h, times = [], x, []
    for index, (name, layer) in enumerate(children):
        with _SavedTensors(exclude=list(model.parameters())) as saved:
            out = layer(_stage_input(h, index))
        big = _layer_times(layer, _stage_input(h, index), repeats)
        times.append((big, _layer_times(layer, _stage_input(h[:small], index), repeats) if small else big))
        layers.append(dict(name=name, output_bytes=_nbytes(out), param_bytes=_param_bytes(layer),
                           activation_bytes=saved.bytes))
        h = out.detach()
    chain = nn.Sequential(*(layer for _, layer in children))
    scale = [(1.0, 1.0), (1.0, 1.0)]
    if calibrate:
        for which, inp in enumerate((x, x[:small] if small else x)):
            # the anchor of every layer's time: more repeats, after a longer warm-up
            whole = _layer_times(chain, inp.detach(), 2 * repeats, warmup=3, min_time_s=ANCHOR_MIN_S)
            parts = [sum(t[which][k] for t in times) for k in (0, 1)]
            scale[which] = tuple(w / p if p > 0 and w > 0 else 1.0 for w, p in zip(whole, parts))
    out_layers = []
    for fields, ((f_big, b_big), (f_small, b_small)) in zip(layers, times):
        f_big, b_big = f_big * scale[0][0], b_big * scale[0][1]
        f_small, b_small = f_small * scale[1][0], b_small * scale[1][1]
        fixed = (_intercept(f_big, f_small, rows, small), _intercept(b_big, b_small, rows, small)) \
            if small else (0.0, 0.0)
        out_layers.append(LayerProfile(forward_s=f_big, backward_s=b_big, forward_fixed_s=fixed[0],
                                       backward_fixed_s=fixed[1], **fields))
    return tuple(out_layers)


def _stage_input(h: torch.Tensor, index: int) -> torch.Tensor:
    """A layer's input as a pipeline stage receives it: detached, requiring grad after the
    first layer."""
    inp = h.detach()
    if index > 0 and inp.is_floating_point():
        inp.requires_grad_(True)
    return inp


def _layer_times(layer: nn.Module, inp: torch.Tensor, repeats: int, warmup: int = 1,
                 min_time_s: float = 0.0) -> tuple[float, float]:
    """Median forward and backward seconds of `layer` on `inp` (backward 0 without grad)."""
    device = inp.device
    fwd = _median_time(lambda: layer(inp), repeats, device, warmup, min_time_s=min_time_s)
    out = layer(inp)
    if not out.requires_grad:
        return fwd, 0.0
    grad = torch.ones_like(out)
    bwd = _median_time(lambda o: torch.autograd.backward(o, grad), repeats, device, warmup,
                       setup=lambda: layer(inp), min_time_s=min_time_s)
    return fwd, bwd


def _intercept(t_big: float, t_small: float, rows: int, small: int) -> float:
    """Intercept of the line through (small, t_small) and (rows, t_big), at most t_small.
    It is negative where a layer is superlinear between the two sizes (a convolution whose
    algorithm changes with the batch): the line still passes through both measured points,
    and the planners floor a time scaled below the smaller size at 0."""
    return min((t_small * rows - t_big * small) / (rows - small), t_small)


def measure_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the whole model keeps for backward on batch `x` (each storage once)."""
    with _SavedTensors(exclude=list(model.parameters())) as saved:
        model(x)
    return saved.bytes


def _training_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> Callable[[], None]:
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _build_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    from engine.optimizers import build_optimizer

    # A tiny rate: the weights barely move, and they are restored afterwards anyway.
    return build_optimizer(name, model, 1e-9)


def measure_peak_memory(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> tuple[int, str, int, int]:
    """(peak bytes, method, RSS growth bytes, optimizer state bytes) of one training step.

    CUDA: `torch.cuda.max_memory_allocated` over the step (method `cuda_max_allocated`).
    CPU (`cpu_accounted`): parameters + gradients + optimizer state + the activations
    autograd keeps + the batch, counted tensor by tensor. The allocator's own slack is
    not in it; the RSS growth over the step (peak RSS after resetting the kernel's mark,
    minus RSS before) is reported beside it for comparison, 0 where it cannot be read."""
    step = _training_step(model, opt, x, y)
    step()  # the optimizer allocates its state on the first step
    state_bytes = sum(_nbytes(v) for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        step()
        torch.cuda.synchronize(x.device)
        return int(torch.cuda.max_memory_allocated(x.device)), "cuda_max_allocated", 0, state_bytes
    before = rss_bytes()
    growth = 0
    if _reset_peak_rss():
        step()
        growth = max(0, _peak_rss_since_reset() - before)
    params = sum(_nbytes(p) for p in model.parameters())
    grads = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
    acts = measure_activation_bytes(model, x)
    peak = params + grads + state_bytes + acts + _nbytes(x) + _nbytes(y)
    return peak, "cpu_accounted", growth, state_bytes


def vcpu_factor(vcpu: float, serial_fraction: float) -> float:
    """Relative step time on `vcpu` vCPUs (1.0 at one vCPU).

    At least one vCPU: Amdahl, s + (1 - s) / v. Below one (a fractional CPU quota) the
    whole step is throttled: 1 / v. The two agree at v = 1."""
    if not vcpu > 0:
        raise ZooidValueError("vcpu", f"must be > 0, got {vcpu!r}")
    if vcpu < 1:
        return 1.0 / vcpu
    return serial_fraction + (1.0 - serial_fraction) / vcpu


def fit_serial_fraction(step_s_by_threads: dict[int, float]) -> float:
    """Amdahl serial fraction s in [0, 1] by least squares on t(n) = t1 (s + (1 - s) / n)
    over the measured thread counts (t1 is the one-thread time); 1.0 with only one count."""
    if 1 not in step_s_by_threads or len(step_s_by_threads) < 2:
        return 1.0
    t1 = step_s_by_threads[1]
    ns = np.array([n for n in step_s_by_threads if n != 1], dtype=float)
    ratio = np.array([step_s_by_threads[int(n)] / t1 for n in ns])
    # ratio - 1/n = s (1 - 1/n): a one-parameter least squares through the origin.
    u = 1.0 - 1.0 / ns
    s = float(u @ (ratio - 1.0 / ns) / (u @ u))
    return min(1.0, max(0.0, s))


def measure_thread_scaling(step: Callable[[], None], device: torch.device, repeats: int,
                           counts: Sequence[int] | None = None) -> dict[int, float]:
    """Median step seconds at each torch thread count (default 1 and every core); the
    thread setting is restored afterwards. On CUDA the host threads hardly matter and
    only the current setting is measured."""
    current = torch.get_num_threads()
    if device.type == "cuda":
        return {current: _median_time(step, repeats, device)}
    counts = sorted(set(counts or (1, cpu_count())))
    out = {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            out[n] = _median_time(step, repeats, device)
    finally:
        torch.set_num_threads(current)
    return out


@functools.lru_cache(maxsize=16)
def measure_base_memory(modules: tuple[str, ...] = ()) -> int:
    """s0: resident bytes of a fresh worker-like process (`profiling.base_memory`) after
    importing torch, the model registry and the user's model `modules` (and running one tiny
    backward), measured once per process in a subprocess and cached.
    The model is not built: its parameters are counted separately by the memory model."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])
    try:
        done = subprocess.run([sys.executable, "-m", "profiling.base_memory", *modules], env=env,
                              capture_output=True, text=True, timeout=300, check=True)
        return int(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise ZooidError(f"measuring the base memory of a worker failed: {detail.strip()[-300:]}") from None


def _model_modules(name: str) -> tuple[str, ...]:
    """The user's modules a worker imports to build model `name` (none for a registry name)."""
    return (name.partition(":")[0],) if ":" in name else ()


def profile_model(model: nn.Module, name: str, input_shape: tuple[int, ...], num_classes: int,
                  batch_size: int, repeats: int = 5, *, microbatch_size: int | None = None,
                  optimizer: str = "sgd", base_memory: bool = True,
                  thread_counts: Sequence[int] | None = None) -> ModelProfile:
    """Profile `model` on synthetic input of `input_shape` on the device its parameters live on.

    Layer and whole-model forward/backward figures are per micro-batch of
    `microbatch_size` samples (default `batch_size`); the step time and peak memory are
    for a full step at `batch_size` with `optimizer`. `base_memory=False` skips the s0
    subprocess; `thread_counts` (default 1 and every core) are where the step is timed to
    fit the vCPU scaling. The model's weights and buffers are restored afterwards."""
    for label, value in (("batch_size", batch_size), ("repeats", repeats),
                         ("microbatch_size", microbatch_size or 1), ("num_classes", num_classes)):
        if not isinstance(value, int) or value < 1:
            raise ZooidValueError(label, f"must be a positive integer, got {value!r}")
    micro = microbatch_size or batch_size
    pin_malloc_thresholds()  # as every worker runs (engine.malloc)
    device = next(model.parameters(), torch.empty(0)).device
    saved_state = copy.deepcopy(model.state_dict())
    was_training = model.training
    model.train()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *input_shape, generator=gen).to(device)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen).to(device)
    xm, ym = x[:micro].contiguous(), y[:micro].contiguous()
    if micro > batch_size:
        xm = torch.randn(micro, *input_shape, generator=gen).to(device)
        ym = torch.randint(0, num_classes, (micro,), generator=gen).to(device)
    try:
        opt = _build_optimizer(optimizer, model)
        step = _training_step(model, opt, x, y)
        threads = torch.get_num_threads()
        # a few more warm-up steps than elsewhere: the allocator and caches settle over the
        # first steps, and a training run is all steady state
        step_s = _median_time(step, 2 * repeats, device, warmup=3, min_time_s=ANCHOR_MIN_S)
        optimizer_step_s = _median_time(opt.step, 2 * repeats, device)  # gradients are in place
        layers = profile_layers(model, xm, repeats, fit_rows=max(1, micro // 4))
        loss_fn = nn.CrossEntropyLoss()
        fwd = _median_time(lambda: loss_fn(model(xm), ym), repeats, device)
        bwd = _median_time(lambda loss: loss.backward(), repeats, device,
                           setup=lambda: loss_fn(model(xm), ym))
        peak, method, growth, state_bytes = measure_peak_memory(model, opt, x, y)
        by_threads = measure_thread_scaling(step, device, max(1, repeats // 2 + 1), thread_counts)
        by_threads.setdefault(threads, step_s)
        activation = measure_activation_bytes(model, x)
    finally:
        model.load_state_dict(saved_state)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return ModelProfile(
        model=name, input_shape=tuple(input_shape), batch_size=batch_size, step_s=step_s,
        optimizer_step_s=optimizer_step_s,
        param_bytes=_param_bytes(model),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        layers=layers, hardware=hardware_fingerprint(threads), microbatch_size=micro,
        forward_s=fwd, backward_s=bwd, activation_bytes=activation, optimizer=optimizer,
        optimizer_state_bytes=state_bytes, peak_memory_bytes=peak, peak_memory_method=method,
        rss_growth_bytes=growth,
        base_memory_bytes=measure_base_memory(_model_modules(name)) if base_memory else 0,
        threads=threads, step_s_by_threads={str(n): s for n, s in sorted(by_threads.items())},
        serial_fraction=fit_serial_fraction(by_threads))


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

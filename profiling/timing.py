"""Time a model on the hardware it will train on, without trusting one short window.

- `_median_time`: the median of repeats after warm-up, sampled for at least `min_time_s`
  and until another round no longer moves it (`ANCHOR_MIN_S`, `STABLE_WITHIN`);
- per top-level layer (children of an `nn.Sequential`, or of any model whose children run
  in order; other models get one whole-model "layer"): forward and backward seconds per
  micro-batch, their per-call parts, output, activation and parameter bytes
  (`profile_layers` -> `LayerProfile`);
- how step time scales with vCPUs (Amdahl's law fitted to steps at 1 thread and at every
  core; `measure_thread_scaling`, `fit_serial_fraction`, `vcpu_factor`), so per-offer
  timings can be scaled to an offer's vCPU count.

The whole-model profile that gathers these is `profiling.profiler.profile_model`; the
memory side is `profiling.memory`.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from core.errors import ZooidValueError
from engine.stages import sequential_children
from profiling.memory import _nbytes, _param_bytes, _SavedTensors


# --- timing primitives ---------------------------------------------------------------------


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
    samples, total = [], 0.0

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


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# --- per-layer times -----------------------------------------------------------------------


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


def _children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level children when they run in order, else [("model", model)]."""
    try:
        return sequential_children(model)
    except ZooidValueError:
        return [("model", model)]


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


def layer_output_bytes(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Bytes of each top-level layer's output on `x` (as `profile_layers` names the layers),
    from one forward pass without gradients: the sizes a pipeline's stages would send."""
    out, h = [], x
    with torch.no_grad():
        for _, layer in _children(model):
            h = layer(h)
            out.append(_nbytes(h))
    return out


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


# --- how step time scales with threads -----------------------------------------------------


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

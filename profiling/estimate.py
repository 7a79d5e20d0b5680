"""A model profile estimated without running the model: what a dry run told to rent nothing plans
from when no profile of the model is cached (`coordinator.target_profile.catalog_profile`).

The model is built on the `meta` device (no weights, no arithmetic) and each top-level layer is
traced forward and backward on one micro-batch under `torch.utils.flop_counter.FlopCounterMode`.
A layer's seconds are then a device's figures applied to what it does:

    seconds = per-call overhead + flops / flop rate + bytes touched / memory rate

with the figures from the price catalog (`planners.catalog.compute_figures`: a CPU vCPU's or a
GPU's, with their sources). Bytes follow from the shapes: output, activation (input and output
of a layer that keeps them), parameters. Measured on this project's registry models on a CPU,
such estimates land within about 2x of the measured profile; the dry run says so and the first
epoch calibrates the plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from core.errors import ZooidValueError
from engine.stages import sequential_children
from profiling.profiler import ModelProfile
from profiling.timing import LayerProfile


@dataclass(frozen=True, kw_only=True)
class DeviceFigures:
    """What one worker's device does per second, and what a call costs, by assumption."""

    flops_per_s: float
    bytes_per_s: float
    forward_call_s: float
    backward_call_s: float
    base_memory_bytes: int
    """s0: a worker process's resident bytes before it builds a model."""
    source: str = ""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _traced(layer: nn.Module, h: torch.Tensor, index: int) -> tuple[torch.Tensor, int, int, int]:
    """`layer`'s output on `h`, its forward and backward flops and the bytes autograd keeps for
    its backward, parameters aside (on `meta`: shapes only)."""
    from torch.utils.flop_counter import FlopCounterMode

    seen = {p.untyped_storage()._cdata for p in layer.parameters()}
    kept = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:  # each storage once; parameters (and their views) are not activations
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            kept[0] += t.untyped_storage().nbytes()
        return t

    inp = h.detach().requires_grad_(index > 0)  # as a pipeline stage receives it: the data needs no gradient
    with FlopCounterMode(display=False) as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(inp)
    back = 0
    if out.requires_grad:
        with FlopCounterMode(display=False) as bwd:
            out.backward(torch.ones_like(out))
        back = bwd.get_total_flops()
    return out.detach(), fwd.get_total_flops(), back, kept[0]


def _seconds(flops: int, touched: int, call_s: float, fig: DeviceFigures) -> float:
    return call_s + flops / fig.flops_per_s + touched / fig.bytes_per_s


def estimate_profile(factory, name: str, input_shape: tuple[int, ...], batch_size: int, microbatch_size: int,
                     optimizer: str, optimizer_copies: int, figures: DeviceFigures, threads: int) -> ModelProfile:
    """The `ModelProfile` of the model `factory` builds, estimated from its shapes and `figures`
    (a device's assumed rates), per micro-batch of `microbatch_size` samples; the whole step at
    `batch_size`. Nothing is computed: the model lives on `meta`."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = factory()
    try:
        children = sequential_children(model)
    except ZooidValueError:
        children = [("model", model)]
    h = torch.empty(microbatch_size, *input_shape, device="meta")
    layers, total_f, total_b, activation = [], 0.0, 0.0, 0
    for index, (lname, layer) in enumerate(children):
        params = sum(_nbytes(p) for p in layer.parameters())
        out, f_flops, b_flops, kept = _traced(layer, h, index)
        touched = _nbytes(h) + _nbytes(out) + params
        fwd = _seconds(f_flops, touched, figures.forward_call_s, figures)
        bwd = _seconds(b_flops, 2 * touched, figures.backward_call_s, figures)
        layers.append({"name": lname, "forward_s": fwd, "backward_s": bwd, "output_bytes": _nbytes(out),
                       "param_bytes": params, "activation_bytes": kept,
                       "forward_fixed_s": figures.forward_call_s, "backward_fixed_s": figures.backward_call_s})
        total_f, total_b, activation = total_f + fwd, total_b + bwd, activation + kept
        h = out
    param_bytes = sum(_nbytes(p) for p in model.parameters())
    state_bytes = optimizer_copies * param_bytes
    optimizer_step_s = figures.forward_call_s * len(list(model.parameters())) + \
        (2 + 2 * optimizer_copies) * param_bytes / figures.bytes_per_s
    rows = batch_size / microbatch_size
    step_s = rows * (total_f + total_b - len(layers) * (figures.forward_call_s + figures.backward_call_s)) + \
        len(layers) * (figures.forward_call_s + figures.backward_call_s) + optimizer_step_s
    activation_at_batch = int(activation * rows)
    return ModelProfile(
        model=name, input_shape=tuple(input_shape), batch_size=batch_size, step_s=step_s,
        optimizer_step_s=optimizer_step_s, param_bytes=param_bytes, peak_rss_bytes=0,
        layers=tuple(LayerProfile(**layer) for layer in layers), hardware="catalog estimate",
        extra={"estimated_from": figures.source}, microbatch_size=microbatch_size, forward_s=total_f,
        backward_s=total_b, activation_bytes=activation_at_batch, optimizer=optimizer,
        optimizer_state_bytes=state_bytes,
        peak_memory_bytes=2 * param_bytes + state_bytes + activation_at_batch, peak_memory_method="estimated",
        base_memory_bytes=figures.base_memory_bytes, threads=threads,
        step_s_by_threads={str(threads): step_s}, serial_fraction=1.0)

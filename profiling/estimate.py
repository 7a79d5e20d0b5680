"""A model profile estimated without running the model: what a dry run told to rent nothing plans
from when no profile of the model is cached (`coordinator.plan.target_profile.catalog_profile`).

The model is built on the `meta` device (no weights, no arithmetic) and each top-level layer is
traced forward and backward on one micro-batch under `torch.utils.flop_counter.FlopCounterMode`.
A layer's seconds are then a device's figures applied to what it does:

    seconds = per-call overhead + flops / flop rate + bytes touched / memory rate

with the figures from the price catalog (`planners.catalog.compute_figures`: a CPU vCPU's or a
GPU's, with their sources). Bytes follow from the shapes: output, activation (input and output
of a layer that keeps them), parameters. Measured on this project's registry models on a CPU,
such estimates land within about 2x of the measured profile; the dry run says so and the first
epoch calibrates the plan.

The micro-batch is shaped as the job's data (`profiling.sample`): float rows, or int64 token ids
[B, T] for a language model. The last layer's activation bytes include what the loss adds at the
head: the logits and the log-softmax the cross-entropy keeps ([B, T, V] each for a language
model; `profiling.memory.loss_memory_bytes`, traced here on `meta`).

Attention (`F.scaled_dot_product_attention`) is traced as the kernel the target runs keeps it
(`attention_kernel`): on a GPU, and on a CPU without dropout, PyTorch runs a flash kernel,
which keeps q, k, v, the output and a log-sum-exp per row, never the T x T scores; on a CPU with
dropout (or a mask) it runs the math kernel, which keeps the softmax's T x T scores per head
(and the dropout's mask beside them). `meta` alone would always trace the math kernel. Flops are
the same matmuls either way (`torch.utils.flop_counter`'s attention formulas). Attention written
out by hand (matmul, softmax) keeps what it keeps, and is counted as traced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import ZooidValueError
from engine.stages import sequential_children
from profiling.profiler import ModelProfile
from profiling.sample import INPUT_DTYPES, profile_loss
from profiling.timing import LayerProfile

ATTENTION_KERNELS = ("flash", "math")


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


def attention_kernel(gpu: bool, dropout_p: float, masked: bool) -> str:
    """The `ATTENTION_KERNELS` name PyTorch's scaled-dot-product attention runs for training:
    flash (or memory-efficient) on a GPU; on a CPU flash without dropout or a mask, else the
    math kernel (torch 2.13 here: `ScaledDotProductFlashAttentionForCpuBackward` without dropout,
    the math kernel's matmuls and softmax with it)."""
    return "flash" if gpu or (dropout_p == 0.0 and not masked) else "math"


class _TargetAttention(torch.overrides.TorchFunctionMode):
    """Runs `F.scaled_dot_product_attention` as the target's kernel keeps its tensors
    (`attention_kernel`): the flash kernel through PyTorch's CPU flash operator (whose `meta`
    form keeps what a flash kernel keeps), the math kernel as `meta` traces it."""

    def __init__(self, gpu: bool):
        super().__init__()
        self.gpu, self.kernels = gpu, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = {**dict(zip(names, args)), **kwargs}
        dropout_p, mask = float(given.get("dropout_p") or 0.0), given.get("attn_mask")
        kernel = attention_kernel(self.gpu, dropout_p, mask is not None)
        self.kernels.append(kernel)
        if kernel == "math" or given.get("enable_gqa"):
            return func(*args, **kwargs)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            given["query"], given["key"], given["value"], dropout_p, bool(given.get("is_causal", False)),
            attn_mask=mask, scale=given.get("scale"))
        return out


def _flop_counter():
    """A `FlopCounterMode` that also counts the CPU flash attention operators (torch counts the
    GPU ones only) by the same attention formulas."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    def forward(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(q, k, v)

    def backward(grad, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad, q, k, v)

    return fc.FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward})


def _traced(layer: nn.Module, h: torch.Tensor, index: int, gpu: bool = False, kernels: list | None = None
            ) -> tuple[torch.Tensor, int, int, int]:
    """`layer`'s output on `h`, its forward and backward flops and the bytes autograd keeps for
    its backward, parameters aside (on `meta`: shapes only; attention as the target's kernel
    keeps it, `gpu` or not)."""
    seen = {p.untyped_storage()._cdata for p in layer.parameters()}
    kept = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:  # each storage once; parameters (and their views) are not activations
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            kept[0] += t.untyped_storage().nbytes()
        return t

    # as a pipeline stage receives it: the data (float rows or token ids) needs no gradient
    inp = h.detach().requires_grad_(index > 0 and h.is_floating_point())
    with _flop_counter() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            _TargetAttention(gpu) as attention:
        out = layer(inp)
    if kernels is not None:
        kernels.extend(attention.kernels)
    back = 0
    if out.requires_grad:
        with _flop_counter() as bwd:
            out.backward(torch.ones_like(out))
        back = bwd.get_total_flops()
    return out.detach(), fwd.get_total_flops(), back, kept[0]


def _loss_bytes(out: torch.Tensor, target: torch.Tensor, loss: str | None = None) -> int:
    """`profiling.memory.loss_memory_bytes` on `meta`: the logits `out` and what the loss keeps
    (the log-softmax and a scalar; a custom `loss`: what it keeps), the target aside."""
    seen, kept = {target.untyped_storage()._cdata}, [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            kept[0] += t.untyped_storage().nbytes()
        return t

    logits = out.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        profile_loss(logits, target, loss)
    return _nbytes(logits) + kept[0]


def _seconds(flops: int, touched: int, call_s: float, fig: DeviceFigures) -> float:
    return call_s + flops / fig.flops_per_s + touched / fig.bytes_per_s


def estimate_profile(factory, name: str, input_shape: tuple[int, ...], batch_size: int, microbatch_size: int,
                     optimizer: str, optimizer_copies: int, figures: DeviceFigures, threads: int, *,
                     input_dtype: str = "float32", target_shape: tuple[int, ...] = (), gpu: bool = False,
                     target_dtype: str = "int64", loss: str | None = None) -> ModelProfile:
    """The `ModelProfile` of the model `factory` builds, estimated from its shapes and `figures`
    (a device's assumed rates), per micro-batch of `microbatch_size` samples of `input_dtype`
    (`int64`: token ids) scored against targets of `target_shape` per sample (`target_dtype`
    `float32`: a custom `loss`'s values) by the job's loss; the whole step at
    `batch_size`; attention as a GPU's kernel keeps it when `gpu`, else a CPU's (module
    docstring). Nothing is computed: the model lives on `meta`."""
    if input_dtype not in INPUT_DTYPES:
        raise ZooidValueError("input_dtype", f"must be one of {', '.join(INPUT_DTYPES)}, got {input_dtype!r}")
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = factory()
    try:
        children = sequential_children(model)
    except ZooidValueError:
        children = [("model", model)]
    dtype = torch.int64 if input_dtype == "int64" else torch.get_default_dtype()
    h = torch.zeros(microbatch_size, *input_shape, dtype=dtype, device="meta")
    target = torch.zeros(microbatch_size, *target_shape, device="meta",
                         dtype=torch.get_default_dtype() if target_dtype == "float32" else torch.int64)
    layers, total_f, total_b, activation, kernels = [], 0.0, 0.0, 0, []
    for index, (lname, layer) in enumerate(children):
        params = sum(_nbytes(p) for p in layer.parameters())
        out, f_flops, b_flops, kept = _traced(layer, h, index, gpu, kernels)
        if index == len(children) - 1:  # the head's stage holds the logits and the loss's log-softmax too
            kept += _loss_bytes(out, target, loss)
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
        model=name, input_shape=tuple(input_shape), input_dtype=input_dtype, target_shape=tuple(target_shape),
        batch_size=batch_size, step_s=step_s, optimizer_step_s=optimizer_step_s, param_bytes=param_bytes,
        peak_rss_bytes=0,
        layers=tuple(LayerProfile(**layer) for layer in layers), hardware="catalog estimate",
        extra={"estimated_from": figures.source, **({"attention_kernels": sorted(set(kernels))} if kernels else {})},
        microbatch_size=microbatch_size, forward_s=total_f,
        backward_s=total_b, activation_bytes=activation_at_batch, optimizer=optimizer,
        optimizer_state_bytes=state_bytes,
        peak_memory_bytes=2 * param_bytes + state_bytes + activation_at_batch, peak_memory_method="estimated",
        base_memory_bytes=figures.base_memory_bytes, threads=threads,
        step_s_by_threads={str(threads): step_s}, serial_fraction=1.0)

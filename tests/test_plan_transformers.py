"""Planning language models: the profile of a transformer (token inputs [B, T], [B, T, d] between
blocks, attention, the embedding and the vocabulary head) agrees with counts made by hand, and the
dry run of `bert_large` on a worker too small for the whole model chooses a pipeline whose every
stage fits, by the memory model's numbers and by an independent count.

The hand counts, in float32 bytes (4 each), for a pre-norm block of width d with H heads on a
micro-batch of B samples of T tokens, as autograd keeps it for the backward pass with a flash
attention kernel (PyTorch's on a GPU, and on a CPU without dropout): the block's input (the first
LayerNorm's), that norm's output (the q/k/v projection's input), q, k and v (3 d), the attention's
output (the output projection's input), the residual sum (the second LayerNorm's input), its
output (the MLP's input), the MLP's hidden layer before and after GELU (4 d each): 16 [B, T, d]
tensors; plus each LayerNorm's mean and reciprocal deviation ([B, T] each) and the attention's
log-sum-exp per row and head ([B, H, T]). No T x T scores. The head keeps its input [B, T, d],
and the loss adds the logits and the log-softmax [B, T, V] each, and a scalar.
"""
from __future__ import annotations

import functools
import math
import tempfile

import pytest
import torch

from core.schedule_costs import ideal_peak_in_flight
from core.stage_memory import parameter_copies, stage_memory
from engine.transformers import bert_base, bert_large, bert_mini
from planners.catalog import device_figures
from profiling.estimate import DeviceFigures, estimate_profile
from profiling.profiler import profile_model

F32 = 4
V = 30522       # BERT's vocabulary
POSITIONS = 512
FIG = DeviceFigures(flops_per_s=1e9, bytes_per_s=1e8, forward_call_s=1e-6, backward_call_s=2e-6,
                    base_memory_bytes=123, source="test figures")


def block_params(d: int) -> int:
    """q/k/v (3d x d + 3d), output projection (d x d + d), MLP (d x 4d + 4d, 4d x d + d), two
    LayerNorms (2d each): 12 d^2 + 13 d."""
    return 12 * d * d + 13 * d


def layer_params(d: int, blocks: int) -> list[int]:
    """Parameters of each top-level child: token and position embeddings, the blocks, the final
    LayerNorm, the head (d x V weights and V biases, not tied to the embedding)."""
    return [(V + POSITIONS) * d] + [block_params(d)] * blocks + [2 * d, d * V + V]


def layer_activations(b: int, t: int, d: int, heads: int, blocks: int) -> list[int]:
    """Bytes each top-level child keeps for backward on a micro-batch (module docstring); the
    embedding keeps the token ids and the positions (int64)."""
    block = F32 * (16 * b * t * d + 2 * 2 * b * t + b * heads * t)
    return ([8 * b * t + 8 * t] + [block] * blocks + [F32 * (b * t * d + 2 * b * t)]
            + [F32 * (b * t * d + 2 * b * t * V + 1)])


def test_bert_base_parameters_are_the_profiles_bytes():
    with torch.device("meta"):
        model = bert_base()
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(layer_params(768, 12)) == 132_361_530
    est = estimate_profile(bert_base, "bert_base", (128,), 8, 4, "adam", 2, FIG, 1,
                           input_dtype="int64", target_shape=(128,))
    assert est.param_bytes == F32 * count
    assert [layer.param_bytes for layer in est.layers] == [F32 * n for n in layer_params(768, 12)]
    assert est.optimizer_state_bytes == 2 * F32 * count  # Adam's two moments
    assert est.input_dtype == "int64" and est.target_shape == (128,)


def test_a_transformers_activations_are_the_hand_count():
    b, t = 4, 128
    est = estimate_profile(bert_base, "bert_base", (t,), 16, b, "adam", 2, FIG, 1,
                           input_dtype="int64", target_shape=(t,))
    assert [layer.activation_bytes for layer in est.layers] == layer_activations(b, t, 768, 12, 12)
    assert [layer.output_bytes for layer in est.layers] == [F32 * b * t * 768] * 14 + [F32 * b * t * V]
    assert est.extra["attention_kernels"] == ["flash"]
    # the head's stage: the logits and the log-softmax dominate ([B, T, V] each, V = 40 d)
    assert est.layers[-1].activation_bytes > 5 * est.layers[1].activation_bytes
    # activations are linear in the samples: the whole step at batch 16 keeps 4 micro-batches' worth
    assert est.activation_bytes == 4 * sum(layer_activations(b, t, 768, 12, 12))


def test_attention_with_dropout_on_a_cpu_keeps_its_scores():
    """The math kernel (a CPU with dropout) keeps the T x T attention per head; a GPU's flash
    kernel never does."""
    b, t, heads = 2, 256, 12
    kwargs = dict(input_dtype="int64", target_shape=(t,))
    flash = estimate_profile(bert_base, "bert_base", (t,), b, b, "sgd", 0, FIG, 1, **kwargs)
    dropout = functools.partial(bert_base, dropout=0.1)
    cpu = estimate_profile(dropout, "bert_base", (t,), b, b, "sgd", 0, FIG, 1, **kwargs)
    gpu = estimate_profile(dropout, "bert_base", (t,), b, b, "sgd", 0, FIG, 1, gpu=True, **kwargs)
    scores = F32 * b * heads * t * t
    assert cpu.extra["attention_kernels"] == ["math"] and gpu.extra["attention_kernels"] == ["flash"]
    assert cpu.layers[1].activation_bytes >= flash.layers[1].activation_bytes + scores
    assert gpu.layers[1].activation_bytes - flash.layers[1].activation_bytes < scores  # dropout's masks only
    # the same matmuls either way (the flash operators counted by the attention formulas)
    assert gpu.layers[1].forward_s == pytest.approx(cpu.layers[1].forward_s, rel=0.02)


def test_the_measured_profile_of_a_transformer_agrees_with_the_estimate():
    """On this CPU (no dropout: the flash kernel), a profile taken on int64 token ids and
    [B, T] targets finds the bytes the estimate traced on `meta`, layer by layer."""
    torch.set_num_threads(1)
    t, v = 32, 258
    est = estimate_profile(bert_mini, "bert_mini", (t,), 8, 4, "adam", 2, FIG, 1, input_dtype="int64",
                           target_shape=(t,))
    model = bert_mini()
    real = profile_model(model, "bert_mini", (t,), v, 8, repeats=1, microbatch_size=4, optimizer="adam",
                         base_memory=False, thread_counts=[1], input_dtype="int64", target_shape=(t,))
    for field in ("output_bytes", "param_bytes", "activation_bytes"):
        assert [getattr(l, field) for l in est.layers] == [getattr(l, field) for l in real.layers], field
    assert real.param_bytes == est.param_bytes
    # Adam's two moments, and a float32 step count per parameter tensor
    assert real.optimizer_state_bytes == 2 * real.param_bytes + F32 * len(list(model.parameters()))
    assert real.layers[-1].activation_bytes == F32 * (4 * t * 64 + 2 * 4 * t * v + 1)
    assert all(layer.backward_s > 0 for layer in real.layers)  # the embedding too: its weights learn


@pytest.mark.usefixtures("prefect_api")
def test_bert_large_on_a_worker_too_small_for_it_is_pipelined_and_every_stage_fits():
    """4 GB workers; bert_large with Adam needs 4 copies of its 1.46 GB of weights on one worker
    (weights, gradients, two moments) before any activation: the dry run (renting nothing,
    planning from the catalog's estimate) chooses a pipeline, and each stage's need, counted here
    by hand, is the memory model's and fits the worker."""
    from coordinator.run.job import TrainJob
    from flows.dry_run import dry_run

    gb, d, blocks, heads, t = 4.0, 1024, 24, 16, 128
    params = layer_params(d, blocks)
    assert parameter_copies(1, 2) * F32 * sum(params) > gb * 2 ** 30  # the whole model cannot fit
    job = TrainJob(model="bert_large", dataset="benchmarks.lm_shapes:bert_mlm_128", workers=4, batch_size=16,
                   optimizer="adam", worker_memory_gb=gb, offer="fargate-cpu", target="inline",
                   store=f"file://{tempfile.mkdtemp()}", epochs=1)
    chosen = dry_run(job, rent=False)
    assert chosen["stages"] > 1 and chosen["worker_memory_gb"] == gb
    local = [a for a in chosen["alternatives"] if a["strategy"] == "local_sgd"]
    assert local and all(a["fits"] is False for a in local)

    micro = chosen["batch_size"] // chosen["microbatches"]
    acts = layer_activations(micro, t, d, heads, blocks)
    base = device_figures(None, 1)["base_memory_bytes"]
    copies = parameter_copies(chosen["data_parallel"], 2)
    starts = [0] + [c + 1 for c in chosen["cuts"]]
    ends = [c + 1 for c in chosen["cuts"]] + [len(params)]
    held = [ideal_peak_in_flight(chosen["pipeline_schedule"], chosen["stages"], chosen["microbatches"], worker=s)
            for s in range(chosen["stages"])]
    by_hand = [held[s] * sum(acts[a:z]) + copies * F32 * sum(params[a:z]) + base
               for s, (a, z) in enumerate(zip(starts, ends))]
    assert all(need <= gb * 2 ** 30 for need in by_hand)
    est = estimate_profile(bert_large, "bert_large", (t,), job.batch_size, micro, "adam", 2, FIG, 1,
                           input_dtype="int64", target_shape=(t,))
    model = stage_memory(activation_bytes=est.layer_activation_bytes(micro),
                         param_bytes=[l.param_bytes for l in est.layers], cuts=starts[1:],
                         microbatches=chosen["microbatches"], available_bytes=gb * 2 ** 30, base_memory_bytes=base,
                         optimizer_state_factor=2, data_parallel=chosen["data_parallel"], in_flight=held)
    assert [s.needed_bytes for s in model] == [pytest.approx(n, rel=1e-12) for n in by_hand]
    assert all(s.fits for s in model)
    assert math.isclose(chosen["price_per_worker_s"], (1 * 0.04048 + gb * 0.004445) / 3600)

"""Hydrozoa pipeline partitioning (Sec. 3.3, App. A), exact, and the micro-batch search.

Runtime model (the contract, PLANNER_SPEC.md `partition`): stages p_1..p_k with forward
and backward sums F_l, B_l; a cut before stage l (l >= 2) costs
c_l = o / bandwidth + latency (direct) or 2 (o / bandwidth + latency) (store: upload then
download), with o the output bytes of the last layer of p_{l-1};
t = max(max F_l, max c_l), r = max(max B_l, max c_l) and

    runtime = sum_l (F_l + B_l) + 2 sum_l c_l + (M - 1) (t + r).

The first sum is the same for every partition; the rest is a sum over cuts plus two
bottleneck terms, which `bottleneck_partition.solve_chain` minimises exactly for every
stage count (not Hydrozoa's epsilon-approximate grid over t and r).

`search_microbatching` is Hydrozoa's search for the micro-batch size and count: sizes in
powers of two while one micro-batch still fits, and for each size a binary search for the
largest count whose activations fit every stage's worker, each pair partitioned exactly
under that memory limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from core.errors import PlannerInputError
from core.stage_memory import stage_bounds, stage_need_bytes
from planners import checks as v
from planners.bottleneck_partition import MaxTerm, interval_sums, solve_chain

TRANSPORTS = ("direct", "store")


@dataclass(frozen=True, kw_only=True)
class PipelineLayer:
    """One layer's profile: seconds per micro-batch and the bytes it hands to the next layer."""

    forward_s: float
    backward_s: float
    output_bytes: float
    param_bytes: float = 0.0
    name: str = ""


@dataclass(frozen=True, kw_only=True)
class PartitionProblem:
    """A partition input (the contract's `partition` document, typed)."""

    layers: tuple[PipelineLayer, ...]
    bandwidth_bytes_per_s: float
    microbatches: int
    max_stages: int
    transport: str = "direct"
    latency_s: float = 0.0


@dataclass(frozen=True)
class PartitionResult:
    """One partition: cuts (0-based, cut i is after layer i), stage count and runtime."""

    cuts: tuple[int, ...]
    stages: int
    runtime_s: float

    def to_dict(self) -> dict[str, Any]:
        """The contract's JSON form."""
        return {"cuts": list(self.cuts), "stages": self.stages, "runtime_s": self.runtime_s}


def cut_times(problem: PartitionProblem) -> np.ndarray:
    """c[i]: seconds to hand layer i's output to layer i + 1 (length L - 1)."""
    out = np.array([layer.output_bytes for layer in problem.layers[:-1]], dtype=float)
    hop = out / problem.bandwidth_bytes_per_s + problem.latency_s
    return 2.0 * hop if problem.transport == "store" else hop


def pipeline_runtime(problem: PartitionProblem, cuts: Sequence[int],
                     microbatches: int | None = None) -> float:
    """The contract's runtime of one mini-batch for the partition given by `cuts`."""
    m = problem.microbatches if microbatches is None else microbatches
    fwd = [layer.forward_s for layer in problem.layers]
    bwd = [layer.backward_s for layer in problem.layers]
    spans = stage_bounds([c + 1 for c in cuts], len(problem.layers))  # cut c is after layer c
    f = [sum(fwd[a:b + 1]) for a, b in spans]
    b_ = [sum(bwd[a:b + 1]) for a, b in spans]
    c = [float(x) for x in cut_times(problem)[list(cuts)]] if cuts else []
    t = max(f + c)
    r = max(b_ + c)
    return sum(f) + sum(b_) + 2 * sum(c) + (m - 1) * (t + r)


def runtime_terms(problem: PartitionProblem, microbatches: int | None = None) -> dict:
    """The pieces `solve_chain` needs for the runtime model: the constant, the cut values,
    the communication weight and the two bottleneck terms (t and r)."""
    m = problem.microbatches if microbatches is None else microbatches
    fwd = np.array([layer.forward_s for layer in problem.layers], dtype=float)
    bwd = np.array([layer.backward_s for layer in problem.layers], dtype=float)
    return {
        "constant": float(fwd.sum() + bwd.sum()),
        "cut_values": cut_times(problem),
        "comm_weight": 2.0,
        "terms": [MaxTerm(float(m - 1), fwd, True), MaxTerm(float(m - 1), bwd, True)],
    }


def plan_partition(problem: PartitionProblem, *, microbatches: int | None = None,
                   allowed: np.ndarray | None = None) -> dict[int, PartitionResult]:
    """The exact least-runtime partition for every stage count 1..min(max_stages, L).

    `allowed[a, b]` (optional) restricts which layer spans may form a stage (memory)."""
    m = problem.microbatches if microbatches is None else microbatches
    parts = runtime_terms(problem, m)
    found = solve_chain(cut_values=parts["cut_values"], comm_weight=parts["comm_weight"],
                        terms=parts["terms"], max_stages=problem.max_stages, allowed=allowed)
    # Re-score with the plain evaluator so the reported runtime is the model's, not the
    # DP's running sum.
    return {k: PartitionResult(s.cuts, k, pipeline_runtime(problem, s.cuts, m))
            for k, s in found.items()}


def best_of(results: dict[int, PartitionResult]) -> PartitionResult:
    """The least runtime over all stage counts (ties: fewer stages)."""
    return min(results.values(), key=lambda r: (r.runtime_s, r.stages))


# --- the JSON command --------------------------------------------------------------------

def parse_layers(doc: dict, *, need_params: bool = False) -> tuple[PipelineLayer, ...]:
    """The `layers` list of a partition or hybrid document."""
    raw = v.array(doc, "layers")
    layers = []
    for i, item in enumerate(raw):
        path = f"layers[{i}]"
        name = v.field_value(item, "name", path, default="")
        layers.append(PipelineLayer(
            forward_s=v.number(item, "forward_s", path, non_negative=True),
            backward_s=v.number(item, "backward_s", path, non_negative=True),
            output_bytes=v.number(item, "output_bytes", path, non_negative=True),
            param_bytes=(v.number(item, "param_bytes", path, non_negative=True)
                         if need_params else 0.0),
            name=str(name)))
    return tuple(layers)


def parse_partition(doc: Any, *, need_microbatches: bool = True,
                    need_params: bool = False) -> PartitionProblem:
    """Validate a partition document into a `PartitionProblem` (PlannerInputError names
    the field)."""
    if not isinstance(doc, dict):
        raise PlannerInputError("input", "must be a JSON object")
    layers = parse_layers(doc, need_params=need_params)
    return PartitionProblem(
        layers=layers,
        bandwidth_bytes_per_s=v.number(doc, "bandwidth_bytes_per_s", positive=True),
        # hybrid ignores `microbatches` (it derives M per strategy), so it is not read
        microbatches=v.integer(doc, "microbatches", minimum=1) if need_microbatches else 1,
        max_stages=v.integer(doc, "max_stages", minimum=1),
        transport=v.choice(doc, "transport", TRANSPORTS, default="direct"),
        latency_s=v.number(doc, "latency_s", non_negative=True, default=0.0))


def partition(doc: dict) -> dict:
    """The `partition` command: JSON document in, JSON answer out (see PLANNER_SPEC.md)."""
    problem = parse_partition(doc)
    results = plan_partition(problem)
    return {"best": best_of(results).to_dict(),
            "by_stages": {str(k): r.to_dict() for k, r in sorted(results.items())}}


# --- micro-batch size and count (Hydrozoa Sec. 3.3) --------------------------------------

@dataclass(frozen=True, kw_only=True)
class LayerMemoryProfile:
    """A layer as the profiler measures it, per sample so that any micro-batch size can be
    priced. Times scale linearly with the micro-batch size (plus a fixed part)."""

    forward_s_per_sample: float
    backward_s_per_sample: float
    output_bytes_per_sample: float
    activation_bytes_per_sample: float
    """Bytes kept per sample until the backward pass (GPipe keeps every micro-batch's)."""
    resident_bytes: float
    """Bytes held whatever the batch: parameters, gradients, optimizer state."""
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0


@dataclass(frozen=True)
class MicrobatchPlan:
    """The chosen micro-batch size and count, its partition and throughput, and every
    (size, count, samples/s) pair considered."""

    microbatch_size: int
    microbatches: int
    partition: PartitionResult
    throughput: float
    considered: tuple[tuple[int, int, float], ...]


def stage_memory_fits(layers: Sequence[LayerMemoryProfile], size: int, count: int,
                      memory_bytes: float, base_bytes: float = 0.0) -> np.ndarray:
    """allowed[a, b]: a stage of layers a..b fits one worker with `count` micro-batches of
    `size` samples in flight (`core.stage_memory.stage_need_bytes` for every span at once;
    resident bytes already count every copy of the parameters, so copies=1)."""
    resident = interval_sums(np.array([x.resident_bytes for x in layers], dtype=float))
    act = interval_sums(np.array([x.activation_bytes_per_sample for x in layers], dtype=float))
    upper = np.triu(np.ones((len(layers), len(layers)), dtype=bool))
    need = stage_need_bytes(activation_bytes=size * act, param_bytes=resident, in_flight=count,
                            copies=1, base_bytes=base_bytes)
    return upper & (need <= memory_bytes)


def _fits_in(layers, size, count, memory_bytes, base_bytes, max_stages) -> bool:
    """Whether some partition into at most `max_stages` stages fits (greedy packing is
    optimal for the fewest stages because stage memory grows with the span)."""
    def fits(act: float, res: float) -> bool:
        return stage_need_bytes(activation_bytes=act, param_bytes=res, in_flight=count, copies=1,
                                base_bytes=base_bytes) <= memory_bytes

    stages, used_res, used_act = 1, 0.0, 0.0
    for x in layers:
        res, act = x.resident_bytes, x.activation_bytes_per_sample * size
        if not fits(act, res):
            return False
        if not fits(used_act + act, used_res + res):
            stages, used_res, used_act = stages + 1, 0.0, 0.0
        used_res += res
        used_act += act
    return stages <= max_stages


def search_microbatching(layers: Sequence[LayerMemoryProfile], *, memory_bytes: float,
                         bandwidth_bytes_per_s: float, max_stages: int,
                         transport: str = "direct", latency_s: float = 0.0,
                         base_memory_bytes: float = 0.0, max_microbatches: int = 1024,
                         max_microbatch_size: int = 1 << 16) -> MicrobatchPlan | None:
    """Hydrozoa's micro-batch search, fed by per-layer memory figures.

    Sizes 1, 2, 4, ... while one micro-batch of that size fits (at most
    `max_microbatch_size`); for each, the largest count <= `max_microbatches` that fits by
    binary search (fitting is monotone in the count); each (size, count) is partitioned
    exactly under the memory limit; the pair with the most samples per second wins.
    None when not even one sample fits."""
    if not layers:
        raise ValueError("layers: must not be empty")
    for name, value in (("memory_bytes", memory_bytes),
                        ("bandwidth_bytes_per_s", bandwidth_bytes_per_s)):
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")
    if max_stages < 1 or max_microbatches < 1 or max_microbatch_size < 1:
        raise ValueError("max_stages: max_stages, max_microbatches and max_microbatch_size "
                         "must be >= 1")
    considered, best = [], None
    size = 1
    while size <= max_microbatch_size and _fits_in(layers, size, 1, memory_bytes,
                                                   base_memory_bytes, max_stages):
        lo, hi = 1, max_microbatches  # lo always fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fits_in(layers, size, mid, memory_bytes, base_memory_bytes, max_stages):
                lo = mid
            else:
                hi = mid - 1
        problem = PartitionProblem(
            layers=tuple(PipelineLayer(
                forward_s=x.forward_fixed_s + x.forward_s_per_sample * size,
                backward_s=x.backward_fixed_s + x.backward_s_per_sample * size,
                output_bytes=x.output_bytes_per_sample * size) for x in layers),
            bandwidth_bytes_per_s=bandwidth_bytes_per_s, microbatches=lo,
            max_stages=max_stages, transport=transport, latency_s=latency_s)
        allowed = stage_memory_fits(layers, size, lo, memory_bytes, base_memory_bytes)
        chosen = best_of(plan_partition(problem, allowed=allowed))
        throughput = size * lo / chosen.runtime_s if chosen.runtime_s > 0 else float("inf")
        considered.append((size, lo, throughput))
        if best is None or throughput > best.throughput:
            best = MicrobatchPlan(size, lo, chosen, throughput, ())
        size *= 2
    if best is None:
        return None
    return MicrobatchPlan(best.microbatch_size, best.microbatches, best.partition,
                          best.throughput, tuple(considered))

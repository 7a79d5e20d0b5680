"""The memory check: does every pipeline stage of a plan fit its worker's memory?

A worker of the stage holding layers S needs, with mu micro-batches in flight per replica
(GPipe keeps every micro-batch's activations until its backward pass), D replicas and an
optimizer that keeps f extra copies of the parameters (0 for SGD, 1 with momentum, 2 for
Adam):

    needed = mu * sum_{i in S} a_i + (4 - 2 [D = 1] + f) * sum_{i in S} s_i + s0

a_i: activation bytes of layer i per micro-batch, s_i: its parameter bytes, s0: the base
memory of a worker process. The parameter factor counts weights and gradients (2) plus,
with D > 1, the two model-sized buffers of the replicas' synchronisation. It is the
co-optimiser's memory constraint (PLANNER_SPEC.md `co-optimize`, FuncPipe Sec. 3.4), so a
plan the planner thinks fits is checked here by the same arithmetic, now against the
worker the plan will actually get, before anything is provisioned.

Cuts here are what `engine.stages.split_stages` and `Plan.cuts` take: the index of the
first layer of each stage after the first (a planner's cut "after layer i" is i + 1).
Sizes are bytes; the messages print GB = 2^30 bytes, as the catalog's `memory_gb` counts.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

from core.errors import ZooidValueError

GB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """One stage's memory need, broken down, against the memory its worker has."""

    stage: int
    first_layer: int
    last_layer: int
    activation_bytes: float
    """mu x the stage's activation bytes per micro-batch."""
    parameter_bytes: float
    """(4 - 2 [D = 1] + f) x the stage's parameter bytes: weights, grads, sync, optimizer."""
    base_bytes: float
    available_bytes: float

    @property
    def needed_bytes(self) -> float:
        """Everything the stage's worker must hold at once."""
        return self.activation_bytes + self.parameter_bytes + self.base_bytes

    @property
    def fits(self) -> bool:
        """Whether the need is within the worker's memory."""
        return self.needed_bytes <= self.available_bytes

    def describe(self) -> str:
        """`stage 1 (layers 0-3) needs 3.20 GB (...), worker has 2.00 GB`."""
        return (f"stage {self.stage} (layers {self.first_layer}-{self.last_layer}) needs "
                f"{format_bytes(self.needed_bytes)} (activations "
                f"{format_bytes(self.activation_bytes)}, parameters with gradients and "
                f"optimizer state {format_bytes(self.parameter_bytes)}, base "
                f"{format_bytes(self.base_bytes)}), worker has "
                f"{format_bytes(self.available_bytes)}")


def format_bytes(n: float) -> str:
    """Bytes for people: GB (2^30) from 0.1 GB up, else MB (2^20)."""
    if n >= 0.1 * GB:
        return f"{n / GB:.2f} GB"
    return f"{n / (1 << 20):.1f} MB"


def stage_bounds(cuts: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    """(first, last) layer of each stage for stage-start `cuts` over `num_layers` layers;
    ZooidValueError naming `cuts` unless they are strictly increasing within 1..L-1.

    The project's one stage-bounds function. A planner whose cut i means "after layer i"
    passes `[i + 1 for i in cuts]`. Integers of any kind (numpy's too) are accepted."""
    cuts = list(cuts)
    if any(not isinstance(c, numbers.Integral) or isinstance(c, bool) for c in cuts):
        raise ZooidValueError("cuts", f"must be integers, got {cuts}")
    cuts = [int(c) for c in cuts]
    if any(b <= a for a, b in zip(cuts, cuts[1:])) or (cuts and not 1 <= cuts[0]) \
            or (cuts and not cuts[-1] <= num_layers - 1):
        raise ZooidValueError("cuts", f"must increase strictly within 1..{num_layers - 1} "
                                      f"for {num_layers} layers, got {cuts}")
    starts = [0] + cuts
    ends = cuts + [num_layers]
    return [(a, b - 1) for a, b in zip(starts, ends)]


def optimizer_copies(optimizer: str) -> int:
    """Parameter-sized tensors the optimizer keeps as state (averaged with the parameters at
    each sync): none for SGD, the momentum buffer, Adam's two moments."""
    return {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]


def parameter_copies(data_parallel: int, optimizer_state_factor: float = 0.0) -> float:
    """4 - 2 [D = 1] + f: how many model-sized copies of a stage's parameters its worker
    holds (weights and gradients, the two sync buffers when D > 1, f optimizer copies)."""
    return 4 - 2 * (data_parallel == 1) + optimizer_state_factor


def stage_need_bytes(*, activation_bytes, param_bytes, in_flight, copies, base_bytes=0.0):
    """The module's formula for one stage: in_flight x activation_bytes + copies x
    param_bytes + base_bytes.

    `activation_bytes` is the stage's activations per micro-batch, `param_bytes` its
    parameter bytes (a caller whose bytes already count every copy passes copies=1).
    Plain arithmetic, so numpy arrays (one entry per candidate stage) work elementwise."""
    return in_flight * activation_bytes + copies * param_bytes + base_bytes


def stage_memory(*, activation_bytes: Sequence[float], param_bytes: Sequence[float],
                 cuts: Sequence[int], microbatches: int, available_bytes: float | Sequence[float],
                 base_memory_bytes: float = 0.0, optimizer_state_factor: float = 0.0,
                 data_parallel: int = 1, in_flight: Sequence[int] | None = None) -> list[StageMemory]:
    """Per stage, what its worker needs (module docstring) next to what it has.

    `activation_bytes` and `param_bytes` are per layer (activations per micro-batch);
    `microbatches` is mu, the micro-batches one replica keeps in flight;
    `in_flight`, per stage, overrides it with what the schedule holds at its peak (1F1B:
    min(k - s, mu) on stage s; `core.schedule_costs.ideal_peak_in_flight`);
    `available_bytes` is one worker size for every stage or one per stage."""
    n = len(activation_bytes)
    if n == 0:
        raise ZooidValueError("activation_bytes", "must list at least one layer")
    if len(param_bytes) != n:
        raise ZooidValueError("param_bytes", f"must have one entry per layer ({n}), got {len(param_bytes)}")
    for label, values in (("activation_bytes", activation_bytes), ("param_bytes", param_bytes)):
        if any(not v >= 0 for v in values):
            raise ZooidValueError(label, f"must be >= 0 bytes, got {list(values)}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ZooidValueError("microbatches", f"must be a positive integer, got {microbatches!r}")
    if not isinstance(data_parallel, int) or data_parallel < 1:
        raise ZooidValueError("data_parallel", f"must be a positive integer, got {data_parallel!r}")
    if not optimizer_state_factor >= 0:
        raise ZooidValueError("optimizer_state_factor", f"must be >= 0, got {optimizer_state_factor!r}")
    if not base_memory_bytes >= 0:
        raise ZooidValueError("base_memory_bytes", f"must be >= 0, got {base_memory_bytes!r}")
    bounds = stage_bounds(cuts, n)
    available = ([float(available_bytes)] * len(bounds)
                 if isinstance(available_bytes, (int, float)) else [float(a) for a in available_bytes])
    if len(available) != len(bounds) or any(not a > 0 for a in available):
        raise ZooidValueError("available_bytes", f"must be one positive size or one per stage "
                                                 f"({len(bounds)}), got {available_bytes!r}")
    held = list(in_flight) if in_flight is not None else [microbatches] * len(bounds)
    if len(held) != len(bounds) or any(not (isinstance(h, int) and 1 <= h <= microbatches) for h in held):
        raise ZooidValueError("in_flight", f"must be one count in 1..{microbatches} per stage "
                                           f"({len(bounds)}), got {in_flight!r}")
    copies = parameter_copies(data_parallel, optimizer_state_factor)
    # the breakdown's three parts are stage_need_bytes's three terms
    return [StageMemory(stage=k, first_layer=a, last_layer=b,
                        activation_bytes=stage_need_bytes(
                            activation_bytes=float(sum(activation_bytes[a:b + 1])), param_bytes=0.0,
                            in_flight=held[k], copies=0.0),
                        parameter_bytes=stage_need_bytes(
                            activation_bytes=0.0, param_bytes=float(sum(param_bytes[a:b + 1])),
                            in_flight=0, copies=copies),
                        base_bytes=float(base_memory_bytes), available_bytes=available[k])
            for k, (a, b) in enumerate(bounds)]


def check_plan_memory(*, activation_bytes: Sequence[float], param_bytes: Sequence[float],
                      cuts: Sequence[int], microbatches: int,
                      available_bytes: float | Sequence[float], base_memory_bytes: float = 0.0,
                      optimizer_state_factor: float = 0.0, data_parallel: int = 1,
                      in_flight: Sequence[int] | None = None) -> list[StageMemory]:
    """The `stage_memory` report when every stage fits; else ZooidValueError("memory", ...)
    naming each stage that does not, with its needed and available bytes."""
    report = stage_memory(activation_bytes=activation_bytes, param_bytes=param_bytes, cuts=cuts,
                          microbatches=microbatches, available_bytes=available_bytes,
                          base_memory_bytes=base_memory_bytes,
                          optimizer_state_factor=optimizer_state_factor, data_parallel=data_parallel,
                          in_flight=in_flight)
    over = [s for s in report if not s.fits]
    if over:
        raise ZooidValueError("memory", "; ".join(s.describe() for s in over))
    return report

"""The co-optimisation's shared data: the problem, a solution, a solver's answer, and memory fit.

`planners.co_optimize` (parsing, scoring, dispatch, Pareto sweep) and the solvers
(`planners.co_optimize_exact`, `planners.co_optimize_miqp`) all import from here, so the
dispatcher depends on the solvers and the solvers never depend on the dispatcher.

Solutions are `CoOptSolution(cuts, d, options)`: sorted cut positions (a cut i splits layers
i and i+1, the planners' convention and `core.plan.Plan.cuts`), the data-parallel degree and
one memory-option index per stage. The flow's plan is `core.plan.Plan`; `coordinator.plan.co_plan` turns
a solution into one (`Plan.stage_memory_gb` carries the per-stage sizes). Stage bounds and
stage memory are `core.stage_memory`'s, the same arithmetic the flow's memory check uses.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.stage_memory import stage_memory
from planners.checks import check_number

# Memory checks allow this relative slack so a solver's rounding cannot flip feasibility.
MEMORY_SLACK = 1e-9


@dataclass(frozen=True, kw_only=True)
class CoOptProblem:
    """The validated co-optimisation input (times s, sizes bytes, prices dollars)."""

    forward_s: tuple[tuple[float, ...], ...]
    """forward_s[i][j]: forward time of layer i per micro-batch on memory option j."""
    backward_s: tuple[tuple[float, ...], ...]
    output_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]
    grad_bytes: tuple[float, ...]
    """grad_bytes[i]: gradient sent from layer i back to layer i-1 (unused for layer 0)."""
    memory_options_bytes: tuple[float, ...]
    bandwidth_bytes_per_s: tuple[float, ...]
    latency_s: float
    contention: float
    base_memory_bytes: float
    dp_degrees: tuple[int, ...]
    microbatches: int
    price_per_byte_s: float
    weights: tuple[float, float]
    price_per_s: tuple[float, ...] | None = None
    optimizer_state_factor: float = 0.0
    sync_bytes_factor: float = 1.0
    """Bytes a data-parallel sync moves per float32 byte of parameters (1.0: float32; the
    job's `sync_dtype` gives `core.outer_sync.wire_bytes(P, dtype) / P`)."""

    def __post_init__(self):
        check_number(self.sync_bytes_factor, "sync_bytes_factor", positive=True)  # parse_problem's check, for direct use

    @property
    def num_layers(self) -> int:
        """L, the number of layers."""
        return len(self.forward_s)

    @property
    def num_options(self) -> int:
        """J, the number of memory options."""
        return len(self.memory_options_bytes)

    def rates(self) -> tuple[float, ...]:
        """Dollars per second of one worker of each memory option."""
        if self.price_per_s is not None:
            return self.price_per_s
        return tuple(self.price_per_byte_s * m for m in self.memory_options_bytes)

    def valid_degrees(self) -> tuple[int, ...]:
        """The degrees d in dp_degrees that divide microbatches."""
        return tuple(d for d in self.dp_degrees if self.microbatches % d == 0)

    def sync_bytes(self, param_bytes):
        """What one data-parallel sync of `param_bytes` float32 bytes moves (scalar or array)."""
        return self.sync_bytes_factor * param_bytes

    def memory_factor(self, d: int) -> float:
        """Copies of the parameters held per worker: 4 - 2[d = 1] + f."""
        return 4.0 - (2.0 if d == 1 else 0.0) + self.optimizer_state_factor


@dataclass(frozen=True)
class CoOptSolution:
    """One decision of the co-optimisation, not a runnable plan: cuts (after layer i), the
    data-parallel degree d and one memory-option index per stage. `coordinator.plan.co_plan` turns it
    into the flow's `core.plan.Plan`."""

    cuts: tuple[int, ...]
    d: int
    options: tuple[int, ...]


def stage_needs(problem: CoOptProblem, cuts, d: int, available) -> list:
    """`core.stage_memory.stage_memory` of the stages for cuts after layer i at degree d, with
    mu = M / d micro-batches of activations held (the co-optimiser's GPipe model)."""
    return stage_memory(activation_bytes=problem.activation_bytes, param_bytes=problem.param_bytes,
                        cuts=[int(c) + 1 for c in cuts], microbatches=problem.microbatches // d,
                        available_bytes=available, base_memory_bytes=problem.base_memory_bytes,
                        optimizer_state_factor=problem.optimizer_state_factor, data_parallel=d)


def check_plan(problem: CoOptProblem, plan: CoOptSolution) -> None:
    """Raise ValueError if `plan` is not a well-formed decision for `problem`."""
    L = problem.num_layers
    cuts = list(plan.cuts)
    if cuts != sorted(set(cuts)) or any(c < 0 or c > L - 2 for c in cuts):
        raise ValueError(f"cuts must be sorted, distinct and in [0, {L - 2}], got {cuts}")
    if len(plan.options) != len(cuts) + 1:
        raise ValueError(f"options needs one entry per stage ({len(cuts) + 1}), got {len(plan.options)}")
    if any(not 0 <= j < problem.num_options for j in plan.options):
        raise ValueError(f"options must be in [0, {problem.num_options - 1}], got {list(plan.options)}")
    if plan.d < 1 or problem.microbatches % plan.d:
        raise ValueError(f"d must divide microbatches ({problem.microbatches}), got {plan.d}")


def plan_fits(problem: CoOptProblem, plan: CoOptSolution) -> bool:
    """Whether every stage of a well-formed solution fits its memory option."""
    sizes = [problem.memory_options_bytes[j] for j in plan.options]
    return all(s.needed_bytes <= s.available_bytes * (1 + MEMORY_SLACK)
               for s in stage_needs(problem, plan.cuts, plan.d, sizes))


@dataclass(frozen=True)
class Solved:
    """A solver's answer: the solution (None: infeasible), which solver produced it, and notes."""

    plan: CoOptSolution | None
    solver: str
    reason: str = ""
    """Why no plan exists, when plan is None."""
    fallback: str = ""
    """Why the requested solver was replaced, when it was."""
    status: str = "optimal"
    gap: float = 0.0

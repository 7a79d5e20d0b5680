"""The co-optimisation's shared data: the problem, a plan, a solver's answer, and memory fit.

`planners.co_optimize` (parsing, scoring, dispatch, Pareto sweep) and the solvers
(`planners.co_optimize_exact`, `planners.co_optimize_miqp`) all import from here, so the
dispatcher depends on the solvers and the solvers never depend on the dispatcher.

Plans are `(cuts, d, options)`: sorted cut positions (a cut i splits layers i and i+1), the
data-parallel degree and one memory-option index per stage.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    def memory_factor(self, d: int) -> float:
        """Copies of the parameters held per worker: 4 - 2[d = 1] + f."""
        return 4.0 - (2.0 if d == 1 else 0.0) + self.optimizer_state_factor


@dataclass(frozen=True)
class Plan:
    """A decision: cuts, data-parallel degree d, one memory-option index per stage."""

    cuts: tuple[int, ...]
    d: int
    options: tuple[int, ...]


def stage_bounds(num_layers: int, cuts) -> list[tuple[int, int]]:
    """(first, last) layer of every stage for sorted, distinct cuts in [0, L-2]."""
    bounds, first = [], 0
    for c in cuts:
        bounds.append((first, c))
        first = c + 1
    bounds.append((first, num_layers - 1))
    return bounds


def stage_memory_bytes(problem: CoOptProblem, first: int, last: int, d: int) -> float:
    """Memory a worker of stage [first, last] needs: mu * sum a + (4 - 2[d=1] + f) * sum s + s0."""
    mu = problem.microbatches // d
    acts = sum(problem.activation_bytes[first:last + 1])
    params = sum(problem.param_bytes[first:last + 1])
    return mu * acts + problem.memory_factor(d) * params + problem.base_memory_bytes


def fits(problem: CoOptProblem, first: int, last: int, d: int, option: int) -> bool:
    """Whether stage [first, last] fits in memory option `option` at degree d."""
    need = stage_memory_bytes(problem, first, last, d)
    return need <= problem.memory_options_bytes[option] * (1 + MEMORY_SLACK)


def check_plan(problem: CoOptProblem, plan: Plan) -> None:
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


def plan_fits(problem: CoOptProblem, plan: Plan) -> bool:
    """Whether every stage of a well-formed plan fits its memory option."""
    return all(fits(problem, a, b, plan.d, j)
               for (a, b), j in zip(stage_bounds(problem.num_layers, plan.cuts), plan.options))


@dataclass(frozen=True)
class Solved:
    """A solver's answer: the plan (None: infeasible), which solver produced it, and notes."""

    plan: Plan | None
    solver: str
    reason: str = ""
    """Why no plan exists, when plan is None."""
    fallback: str = ""
    """Why the requested solver was replaced, when it was."""
    status: str = "optimal"
    gap: float = 0.0

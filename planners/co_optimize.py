"""FuncPipe co-optimisation: partition + per-stage memory + data-parallel degree (Sec. 3.4, App. B).

The contract is the "co-optimize" section of PLANNER_SPEC.md. The shared data (`CoOptProblem`,
`CoOptSolution`, `Solved`, the memory checks) lives in `planners.co_optimize_problem`, which the solvers
import too. This module owns:

- `parse_problem`: the validated input as a `CoOptProblem` (errors name the JSON field);
- `evaluate`: the one scorer of the contract's model; every solver's plan is re-scored with it,
  so solvers can only disagree on which plan they found, never on what a plan costs;
- `co_optimize(doc)`: dispatch to the exact solver (default), gurobipy or SCIP, the Pareto
  sweep and the recommendation rule (delta >= 0.8);
- `merge_layers`: merging adjacent layers by balanced compute time (FuncPipe Sec. 4) to keep
  the MIQP small. Merging *changes the problem* (cuts can only fall on group boundaries), so
  its optimum can be worse than the unmerged one; compare solvers on the same merged problem.
"""
from __future__ import annotations

import math
from dataclasses import replace

from core.errors import PlannerInputError
from core.stage_memory import stage_bounds
from planners import checks as v
from planners.co_optimize_exact import solve_exact
from planners.co_optimize_miqp import solve_miqp
from planners.co_optimize_problem import CoOptProblem, CoOptSolution, Solved, check_plan

SOLVERS = ("exact", "gurobi", "scip")
DELTA_THRESHOLD = 0.8
# Normalised time weights for "auto": objective = c / c_mc + w * t / t_tmin (w = inf: time only).
AUTO_TIME_WEIGHTS = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0, 4.0, 8.0, 16.0, math.inf)


# ----------------------------------------------------------------------------- validation

def parse_problem(doc: dict) -> CoOptProblem:
    """Validate a co-optimize document; raise PlannerInputError naming the field."""
    if not isinstance(doc, dict):
        raise PlannerInputError("input", "must be a JSON object")
    memory = [v.check_number(m, f"memory_options_bytes[{j}]", positive=True)
              for j, m in enumerate(v.array(doc, "memory_options_bytes"))]
    J = len(memory)
    bandwidth = [v.check_number(w, f"bandwidth_bytes_per_s[{j}]", positive=True)
                 for j, w in enumerate(v.array(doc, "bandwidth_bytes_per_s", length=J))]
    layers = v.array(doc, "layers")
    fwd, bwd, out, act, par, grad = [], [], [], [], [], []
    for i, layer in enumerate(layers):
        path = f"layers[{i}]"
        if not isinstance(layer, dict):
            raise PlannerInputError(path, "must be a JSON object")
        fwd.append(tuple(v.check_number(t, f"{path}.forward_s[{j}]", non_negative=True)
                         for j, t in enumerate(v.array(layer, "forward_s", path, length=J))))
        bwd.append(tuple(v.check_number(t, f"{path}.backward_s[{j}]", non_negative=True)
                         for j, t in enumerate(v.array(layer, "backward_s", path, length=J))))
        out.append(v.number(layer, "output_bytes", path, non_negative=True))
        act.append(v.number(layer, "activation_bytes", path, non_negative=True))
        par.append(v.number(layer, "param_bytes", path, non_negative=True))
        default_grad = out[i - 1] if i > 0 else 0.0
        grad.append(v.number(layer, "grad_bytes", path, non_negative=True, default=default_grad))
    degrees = []
    for k, d in enumerate(v.array(doc, "dp_degrees")):
        d = v.check_integer(d, f"dp_degrees[{k}]", minimum=1)
        if d not in degrees:
            degrees.append(d)
    weights = parse_weights(doc.get("weights"), "weights")
    price_per_s = None
    if doc.get("price_per_s") is not None:
        price_per_s = tuple(v.check_number(p, f"price_per_s[{j}]", non_negative=True)
                            for j, p in enumerate(v.array(doc, "price_per_s", length=J)))
    return CoOptProblem(
        forward_s=tuple(fwd), backward_s=tuple(bwd), output_bytes=tuple(out),
        activation_bytes=tuple(act), param_bytes=tuple(par), grad_bytes=tuple(grad),
        memory_options_bytes=tuple(memory), bandwidth_bytes_per_s=tuple(bandwidth),
        latency_s=v.number(doc, "latency_s", non_negative=True),
        contention=v.number(doc, "contention", minimum=1.0),
        base_memory_bytes=v.number(doc, "base_memory_bytes", non_negative=True),
        dp_degrees=tuple(degrees),
        microbatches=v.integer(doc, "microbatches", minimum=1),
        price_per_byte_s=v.number(doc, "price_per_byte_s", non_negative=True),
        weights=weights, price_per_s=price_per_s,
        optimizer_state_factor=v.number(doc, "optimizer_state_factor", non_negative=True, default=0.0),
        sync_bytes_factor=v.number(doc, "sync_bytes_factor", positive=True, default=1.0),
    )


def parse_weights(value, name: str) -> tuple[float, float]:
    """A pair [alpha1, alpha2] of non-negative numbers, not both zero."""
    if value is None:
        raise PlannerInputError(name, "is required")
    if not isinstance(value, list) or len(value) != 2:
        raise PlannerInputError(name, "must be a list [alpha1, alpha2]")
    pair = tuple(v.check_number(w, f"{name}[{k}]", non_negative=True) for k, w in enumerate(value))
    if pair == (0.0, 0.0):
        raise PlannerInputError(name, "must not both be zero")
    return pair


def parse_pareto(value) -> list[tuple[float, float]] | str | None:
    """`pareto`: absent, "auto", or a non-empty list of weight pairs."""
    if value is None:
        return None
    if value == "auto":
        return "auto"
    if not isinstance(value, list) or not value:
        raise PlannerInputError("pareto", 'must be "auto" or a non-empty list of [alpha1, alpha2]')
    return [parse_weights(pair, f"pareto[{k}]") for k, pair in enumerate(value)]


# ----------------------------------------------------------------------------- the model

def evaluate(problem: CoOptProblem, cuts, d: int, options) -> tuple[float, float, float]:
    """(t_iter, c_iter, objective) of a plan under the contract's model (memory not checked)."""
    plan = CoOptSolution(tuple(cuts), int(d), tuple(options))
    check_plan(problem, plan)
    mu = problem.microbatches // d
    beta, lat = problem.contention, problem.latency_s
    W = problem.bandwidth_bytes_per_s
    bounds = stage_bounds([c + 1 for c in plan.cuts], problem.num_layers)   # stage starts
    k = len(bounds)
    fc, bc, sync = [], [], []
    for (a, b), j in zip(bounds, plan.options):
        fc.append(beta * sum(problem.forward_s[i][j] for i in range(a, b + 1)))
        bc.append(beta * sum(problem.backward_s[i][j] for i in range(a, b + 1)))
        params = sum(problem.param_bytes[a:b + 1])
        sync.append(2 * problem.sync_bytes(params) / W[j] + (2 + d) * lat if d > 1 else 0.0)
    # Communication of the cut after stage l (between stage l and l + 1).
    fwd_comm, bwd_comm = [], []
    for l in range(k - 1):
        i = bounds[l][1]
        w_before, w_after = W[plan.options[l]], W[plan.options[l + 1]]
        o, g = problem.output_bytes[i], problem.grad_bytes[i + 1]
        fwd_comm.append((o / w_before + lat, o / w_after + lat))   # upload, download
        bwd_comm.append((g / w_after + lat, g / w_before + lat))   # upload, download
    lag_f = max(fc + [t for pair in fwd_comm for t in pair])
    t_f = sum(fc) + sum(u + dl for u, dl in fwd_comm) + (mu - 1) * lag_f
    worst_b = 0.0
    for l in range(k):
        later_comm = [t for pair in bwd_comm[l:] for t in pair]
        lag_b = max(bc[l:] + later_comm)
        t_b = sum(bc[l:]) + sum(later_comm) + (mu - 1) * lag_b
        worst_b = max(worst_b, t_b + sync[l])
    t_iter = t_f + worst_b
    rates = problem.rates()
    c_iter = t_iter * d * sum(rates[j] for j in plan.options)
    a1, a2 = problem.weights
    return t_iter, c_iter, a1 * c_iter + a2 * t_iter


# ----------------------------------------------------------------------------- merging

def merge_layers(problem: CoOptProblem, max_layers: int) -> tuple[CoOptProblem, list[tuple[int, int]]]:
    """Merge adjacent layers into at most `max_layers` groups of balanced compute time.

    Compute time of a layer is its forward + backward time averaged over memory options; the
    groups minimise the largest group's compute time (an exact min-max contiguous split).
    Returns the merged problem and each group's (first, last) original layer. The merged
    problem is a different problem: cuts may only fall between groups.
    """
    if isinstance(max_layers, bool) or not isinstance(max_layers, int) or max_layers < 1:
        raise PlannerInputError("max_layers", f"must be an integer >= 1, got {max_layers!r}")
    L, J = problem.num_layers, problem.num_options
    if L <= max_layers:
        return problem, [(i, i) for i in range(L)]
    work = [sum(problem.forward_s[i]) / J + sum(problem.backward_s[i]) / J for i in range(L)]
    groups = _balanced_groups(work, max_layers)

    def merged_sum(values, a, b):
        return sum(values[a:b + 1])

    merged = replace(
        problem,
        forward_s=tuple(tuple(merged_sum([problem.forward_s[i][j] for i in range(L)], a, b)
                              for j in range(J)) for a, b in groups),
        backward_s=tuple(tuple(merged_sum([problem.backward_s[i][j] for i in range(L)], a, b)
                               for j in range(J)) for a, b in groups),
        output_bytes=tuple(problem.output_bytes[b] for a, b in groups),
        activation_bytes=tuple(merged_sum(problem.activation_bytes, a, b) for a, b in groups),
        param_bytes=tuple(merged_sum(problem.param_bytes, a, b) for a, b in groups),
        grad_bytes=tuple(problem.grad_bytes[a] for a, b in groups),
    )
    return merged, groups


def _balanced_groups(work: list[float], count: int) -> list[tuple[int, int]]:
    """Contiguous groups (at most `count`) minimising the largest group's work (exact DP)."""
    L = len(work)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    # best[g][i]: least max-group work splitting the first i layers into g groups.
    best = [[math.inf] * (L + 1) for _ in range(count + 1)]
    arg = [[0] * (L + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for g in range(1, count + 1):
        for i in range(g, L + 1):
            for s in range(g - 1, i):
                cand = max(best[g - 1][s], prefix[i] - prefix[s])
                if cand < best[g][i]:
                    best[g][i], arg[g][i] = cand, s
    groups, i = [], L
    for g in range(count, 0, -1):
        s = arg[g][i]
        groups.append((s, i - 1))
        i = s
    return groups[::-1]


def expand_cuts(groups: list[tuple[int, int]], cuts) -> list[int]:
    """Cuts of a merged problem as cuts between original layers."""
    return [groups[c][1] for c in cuts]


# ----------------------------------------------------------------------------- dispatch

def solve(problem: CoOptProblem, solver: str = "exact", time_limit_s: float | None = None) -> Solved:
    """Solve one weighted problem with `solver` ("exact", "gurobi" or "scip")."""
    if not problem.valid_degrees():
        return Solved(None, solver, reason="no degree in dp_degrees divides microbatches")
    if solver == "exact":
        plan = solve_exact(problem)
        reason = "" if plan else "no stage assignment fits the memory options at any degree"
        return Solved(plan, "exact", reason=reason)
    return solve_miqp(problem, backend=solver, time_limit_s=time_limit_s)


def describe(problem: CoOptProblem, plan: CoOptSolution, groups=None) -> dict:
    """The contract's JSON answer for one plan, scored by `evaluate`."""
    t_iter, c_iter, objective = evaluate(problem, plan.cuts, plan.d, plan.options)
    cuts = expand_cuts(groups, plan.cuts) if groups else list(plan.cuts)
    return {"feasible": True, "cuts": cuts, "data_parallel": plan.d,
            "stage_memory_bytes": [problem.memory_options_bytes[j] for j in plan.options],
            "t_iter_s": t_iter, "c_iter": c_iter, "objective": objective}


def co_optimize(doc: dict) -> dict:
    """The `co-optimize` command: validate, solve, and add the Pareto sweep when asked.

    Optional fields beyond the contract: `solver` ("exact", "gurobi", "scip"),
    `time_limit_s` (MIQP solvers), `max_layers` (merge layers first, see `merge_layers`) and
    `sync_bytes_factor` (bytes a data-parallel sync moves per float32 parameter byte, > 0;
    default 1.0, float32: every solver prices a stage's sync as 2 * factor * param_bytes / W
    + (2 + d) * latency).
    """
    problem = parse_problem(doc)
    solver = v.choice(doc, "solver", SOLVERS, default="exact")
    time_limit = None
    if doc.get("time_limit_s") is not None:
        time_limit = v.number(doc, "time_limit_s", positive=True)
    pareto = parse_pareto(doc.get("pareto"))
    groups = None
    if doc.get("max_layers") is not None:
        problem, groups = merge_layers(problem, v.integer(doc, "max_layers", minimum=1))

    def run(p: CoOptProblem) -> tuple[dict, Solved]:
        solved = solve(p, solver, time_limit)
        if solved.plan is None:
            return {"feasible": False, "reason": solved.reason}, solved
        return describe(p, solved.plan, groups), solved

    answer, solved = run(problem)
    answer.update(_solver_fields(solved))
    if groups is not None:
        answer["merged_layers"] = [list(g) for g in groups]
    if pareto is not None and answer["feasible"]:
        answer.update(pareto_sweep(problem, pareto, run))
    return answer


def _solver_fields(solved: Solved) -> dict:
    fields = {"solver": solved.solver, "status": solved.status}
    if solved.status != "optimal":
        fields["gap"] = solved.gap if math.isfinite(solved.gap) else None  # None: no bound
    if solved.fallback:
        fields["fallback"] = solved.fallback
    return fields


# ----------------------------------------------------------------------------- Pareto sweep

def pareto_sweep(problem: CoOptProblem, pareto, run) -> dict:
    """The sweep (one solution per weight pair) and the recommended solution.

    `run(problem) -> (answer dict, Solved)` solves one weighted problem. For "auto", weights
    are (1 / c_mc, w / t_tmin) for w in AUTO_TIME_WEIGHTS: cost and time normalised by the
    minimum-cost and the minimum-time solutions, so the sweep means the same in any units.
    """
    cheapest, _ = run(replace(problem, weights=(1.0, 0.0)))
    if pareto == "auto":
        fastest, _ = run(replace(problem, weights=(0.0, 1.0)))
        c_mc, t_tmin = cheapest["c_iter"], fastest["t_iter_s"]
        pairs = [_auto_pair(w, c_mc, t_tmin) for w in AUTO_TIME_WEIGHTS]
    else:
        pairs = pareto
    sweep = []
    for pair in pairs:
        answer, solved = run(replace(problem, weights=pair))
        answer = {"weights": list(pair), **answer, **_solver_fields(solved)}
        sweep.append(answer)
    return {"pareto": sweep, "recommended": recommend(cheapest, sweep)}


def _auto_pair(w: float, c_mc: float, t_tmin: float) -> tuple[float, float]:
    """Input-unit weights for normalised cost weight 1 and time weight w (inf: time only)."""
    if math.isinf(w):
        return (0.0, 1.0 / t_tmin if t_tmin > 0 else 1.0)
    cost_w = 1.0 / c_mc if c_mc > 0 else 1.0
    return (cost_w, w / t_tmin if t_tmin > 0 else w)


def delta(cheapest: dict, candidate: dict) -> float:
    """FuncPipe's delta = (t_mc / t_p - 1) / (c_p / c_mc - 1); infinite when c_p <= c_mc."""
    c_mc, t_mc = cheapest["c_iter"], cheapest["t_iter_s"]
    c_p, t_p = candidate["c_iter"], candidate["t_iter_s"]
    if c_p <= c_mc:
        return math.inf
    speedup = t_mc / t_p - 1 if t_p > 0 else math.inf
    return speedup / (c_p / c_mc - 1)


def recommend(cheapest: dict, sweep: list[dict]) -> dict:
    """The fastest solution with delta >= 0.8 against the minimum-cost one (itself if none)."""
    best = dict(cheapest, delta=math.inf)
    for answer in sweep:
        if not answer.get("feasible"):
            continue
        dlt = delta(cheapest, answer)
        if dlt >= DELTA_THRESHOLD and answer["t_iter_s"] < best["t_iter_s"]:
            best = dict(answer, delta=dlt)
    if math.isinf(best["delta"]):
        best["delta"] = None  # JSON has no infinity: null means "at most as costly as c_mc"
    return best

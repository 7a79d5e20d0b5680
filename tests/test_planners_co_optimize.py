"""co-optimize: exact solver vs brute force, MIQP (gurobipy, SCIP) vs exact, licence fallback,
Pareto sweep and recommendation, layer merging, and invalid input naming the field."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import random
import sys

import numpy as np
import pytest

from core.errors import PlannerInputError
from core.outer_sync import wire_bytes
from planners.co_optimize import co_optimize, evaluate, expand_cuts, merge_layers, parse_problem, recommend
from planners.co_optimize_exact import solve_exact
from planners.co_optimize_miqp import model_size, solve_miqp
from planners.co_optimize_problem import CoOptSolution, plan_fits

REL = 1e-9


def random_doc(rng: random.Random, L: int, J: int, K: int) -> dict:
    """A small random instance; optional fields appear at random; some are infeasible."""
    doc = {
        "layers": [],
        "memory_options_bytes": sorted(rng.sample(range(100, 2000, 50), J)),
        "bandwidth_bytes_per_s": [rng.uniform(1, 10) for _ in range(J)],
        "latency_s": rng.choice([0.0, rng.uniform(0, 0.5)]),
        "contention": rng.uniform(1, 1.5),
        "base_memory_bytes": rng.uniform(0, 100),
        "dp_degrees": rng.sample([1, 2, 3, 4, 6], K),
        "microbatches": rng.choice([1, 2, 4, 6, 12]),
        "price_per_byte_s": rng.uniform(0.1, 1),
        "weights": rng.choice([[1, 0], [0, 1], [rng.uniform(0, 2), rng.uniform(0, 2)]]),
    }
    for _ in range(L):
        layer = {"forward_s": [rng.uniform(0, 3) for _ in range(J)],
                 "backward_s": [rng.uniform(0, 5) for _ in range(J)],
                 "output_bytes": rng.uniform(0, 20), "activation_bytes": rng.uniform(0, 60),
                 "param_bytes": rng.uniform(0, 80)}
        if rng.random() < 0.3:
            layer["grad_bytes"] = rng.uniform(0, 20)
        doc["layers"].append(layer)
    if rng.random() < 0.3:
        doc["price_per_s"] = [rng.uniform(0.1, 5) for _ in range(J)]
    if rng.random() < 0.3:
        doc["optimizer_state_factor"] = rng.choice([0, 1, 2, 0.5])
    draw = rng.random()
    if draw < 0.25:
        doc["pareto"] = [[1, 0], [rng.uniform(0, 2), rng.uniform(0, 2)], [0, 1]]
    elif draw < 0.35:
        doc["pareto"] = "auto"
    if rng.random() < 0.05:
        doc["dp_degrees"], doc["microbatches"] = [4, 6], 5    # no degree divides M
    return doc


def all_plans(problem):
    """Every plan that fits memory, with its (t_iter, c_iter): the brute-force reference."""
    L, J = problem.num_layers, problem.num_options
    plans, t, c = [], [], []
    for d in problem.valid_degrees():
        for mask in range(2 ** (L - 1)):
            cuts = tuple(i for i in range(L - 1) if mask >> i & 1)
            for options in itertools.product(range(J), repeat=len(cuts) + 1):
                plan = CoOptSolution(cuts, d, options)
                if plan_fits(problem, plan):
                    t_iter, c_iter, _ = evaluate(problem, cuts, d, options)
                    plans.append(plan)
                    t.append(t_iter)
                    c.append(c_iter)
    return plans, np.array(t), np.array(c)


def brute_best(t, c, weights):
    return float(np.min(weights[0] * c + weights[1] * t))


# Two stages ([0], [1, 2]) at d = 2, M = 4: the plan the evaluator's hand computation prices.
HAND_DOC = {"layers": [
    {"forward_s": [1.0], "backward_s": [2.0], "output_bytes": 10, "activation_bytes": 1, "param_bytes": 20},
    {"forward_s": [2.0], "backward_s": [3.0], "output_bytes": 4, "activation_bytes": 1, "param_bytes": 10},
    {"forward_s": [1.0], "backward_s": [1.0], "output_bytes": 0, "activation_bytes": 1, "param_bytes": 10}],
    "memory_options_bytes": [1000], "bandwidth_bytes_per_s": [10], "latency_s": 0.5,
    "contention": 1.0, "base_memory_bytes": 0, "dp_degrees": [2], "microbatches": 4,
    "price_per_byte_s": 0.001, "weights": [1, 1]}


def close(a, b, rel=REL):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


# ----------------------------------------------------------------------------- the evaluator

def test_evaluate_matches_hand_computed_two_stage_plan():
    # Two stages ([0], [1, 2]), d = 2, M = 4 -> mu = 2, one memory option, beta = 1.
    doc = HAND_DOC
    p = parse_problem(doc)
    t_iter, c_iter, objective = evaluate(p, [0], 2, [0, 0])
    # Forward: Fc = 1, 3; cut after layer 0 moves 10 bytes at 10 B/s: up = down = 1.5.
    # t_f = 4 + 3 + (2 - 1) * max(1, 3, 1.5, 1.5) = 10.
    # Gradient to layer 0 = output of layer 0 = 10 bytes: up = down = 1.5.
    # t_b(stage 2) = 4 + 1 * 4 = 8, sync = 2 * 20 / 10 + 4 * 0.5 = 6 -> 14.
    # t_b(stage 1) = 6 + 3 + 1 * max(2, 4, 1.5, 1.5) = 13, sync = 2 * 20 / 10 + 2 = 6 -> 19.
    assert t_iter == pytest.approx(29.0)
    assert c_iter == pytest.approx(29.0 * 2 * 2 * 1000 * 0.001)
    assert objective == pytest.approx(c_iter + t_iter)


# ----------------------------------------------------------------------------- exact vs brute force

@pytest.mark.parametrize("seed", range(4))
def test_exact_solver_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    infeasible = 0
    for _ in range(55):
        doc = random_doc(rng, rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 3))
        problem = parse_problem(doc)
        plans, t, c = all_plans(problem)
        answer = co_optimize(doc)
        json.dumps(answer, allow_nan=False)
        assert answer["solver"] == "exact"
        if not plans:
            infeasible += 1
            assert answer["feasible"] is False and answer["reason"]
            continue
        assert answer["feasible"] is True
        assert close(answer["objective"], brute_best(t, c, problem.weights))
        plan = CoOptSolution(tuple(answer["cuts"]), answer["data_parallel"],
                    tuple(problem.memory_options_bytes.index(m) for m in answer["stage_memory_bytes"]))
        assert plan_fits(problem, plan)
        if "pareto" in doc:
            check_pareto(doc, answer, t, c)
    assert infeasible > 0       # the sample covers infeasible instances


def test_exact_solver_matches_brute_force_when_memory_forces_many_stages():
    rng = random.Random(99)
    stages = set()
    for _ in range(30):
        doc = random_doc(rng, rng.randint(5, 7), rng.randint(2, 3), 2)
        doc.pop("pareto", None)
        doc.update(dp_degrees=[1, 2], microbatches=4, weights=[rng.uniform(0, 1), 1.0])
        per_layer = max(4 * l["activation_bytes"] + 4 * l["param_bytes"] for l in doc["layers"])
        doc["memory_options_bytes"] = sorted(rng.uniform(1.0, 3.0) * per_layer + doc["base_memory_bytes"]
                                             for _ in doc["memory_options_bytes"])
        problem = parse_problem(doc)
        plans, t, c = all_plans(problem)
        answer = co_optimize(doc)
        assert close(answer["objective"], brute_best(t, c, problem.weights))
        stages.add(len(answer["cuts"]) + 1)
    assert max(stages) >= 4


def check_pareto(doc, answer, t, c):
    sweep = answer["pareto"]
    if doc["pareto"] == "auto":
        # Normalised by the least cost and the least time over all plans.
        c_mc, t_min = float(c.min()), float(t.min())
        assert len(sweep) == 11
        assert sweep[0]["weights"][1] == 0 and close(sweep[0]["c_iter"], c_mc)
        assert sweep[-1]["weights"][0] == 0 and close(sweep[-1]["t_iter_s"], t_min)
        if c_mc > 0:
            assert close(sweep[5]["weights"][0], 1 / c_mc) and close(sweep[5]["weights"][1], 1 / t_min)
    else:
        assert [entry["weights"] for entry in sweep] == doc["pareto"]
    for entry in sweep:
        assert close(entry["objective"], brute_best(t, c, entry["weights"]))
    cheapest_index = int(np.argmin(c))
    cheapest = {"t_iter_s": float(t[cheapest_index]), "c_iter": float(c[cheapest_index])}
    expected = cheapest
    for entry in sweep:
        better = entry["c_iter"] <= cheapest["c_iter"] or (
            (cheapest["t_iter_s"] / entry["t_iter_s"] - 1) / (entry["c_iter"] / cheapest["c_iter"] - 1) >= 0.8)
        if better and entry["t_iter_s"] < expected["t_iter_s"]:
            expected = entry
    assert close(answer["recommended"]["t_iter_s"], expected["t_iter_s"])


def test_recommendation_rule_on_known_points():
    cheapest = {"t_iter_s": 10.0, "c_iter": 1.0}
    sweep = [{"feasible": True, "t_iter_s": 5.0, "c_iter": 1.5},    # delta (2 - 1) / 0.5 = 2
             {"feasible": True, "t_iter_s": 4.0, "c_iter": 3.0},    # delta 1.5 / 2 = 0.75
             {"feasible": True, "t_iter_s": 6.0, "c_iter": 1.0}]    # no dearer: delta infinite
    best = recommend(cheapest, sweep)
    assert (best["t_iter_s"], best["delta"]) == (5.0, 2.0)
    assert recommend(cheapest, sweep[1:2])["t_iter_s"] == 10.0   # only the cheapest qualifies


# ----------------------------------------------------------------------------- MIQP

def small_instances(count, seed):
    rng = random.Random(seed)
    found = []
    while len(found) < count:
        doc = random_doc(rng, rng.randint(2, 4), rng.randint(1, 3), rng.randint(1, 3))
        doc.pop("pareto", None)
        if rng.random() < 0.7:
            doc["weights"] = [1.0, rng.uniform(0.1, 2)]          # keep the bilinear term
        problem = parse_problem(doc)
        if problem.valid_degrees():
            found.append(problem)
    return found


@pytest.mark.parametrize("backend", ["gurobi", "scip"])
def test_miqp_reaches_the_exact_optimum(backend):
    for problem in small_instances(6, seed=7):
        plan = solve_exact(problem)
        solved = solve_miqp(problem, backend=backend)
        assert solved.solver == backend and not solved.fallback
        if plan is None:
            assert solved.plan is None
            continue
        assert solved.status == "optimal"
        assert plan_fits(problem, solved.plan)
        got = evaluate(problem, solved.plan.cuts, solved.plan.d, solved.plan.options)[2]
        want = evaluate(problem, plan.cuts, plan.d, plan.options)[2]
        assert close(got, want, rel=1e-6)


def over_licence_doc():
    """9 layers, 3 options, 3 degrees: the MIQP has just over 200 variables."""
    rng = random.Random(1)
    doc = random_doc(rng, 9, 3, 3)
    doc.update(weights=[1.0, 0.5], dp_degrees=[1, 2, 3], microbatches=6)
    doc.pop("pareto", None)
    return doc


def test_gurobi_licence_limit_falls_back_to_scip():
    doc = over_licence_doc()
    problem = parse_problem(doc)
    variables, _ = model_size(problem)
    assert 200 < variables < 230
    answer = co_optimize({**doc, "solver": "gurobi"})
    assert answer["solver"] == "scip"
    assert "10010" in answer["fallback"]
    exact = co_optimize(doc)
    assert close(answer["objective"], exact["objective"], rel=1e-6)


def test_gurobi_missing_falls_back_to_scip(monkeypatch):
    monkeypatch.setitem(sys.modules, "gurobipy", None)    # import gurobipy now raises ImportError
    problem = small_instances(1, seed=3)[0]
    solved = solve_miqp(problem, backend="gurobi")
    assert solved.solver == "scip" and "cannot be imported" in solved.fallback


def test_gurobi_answers_when_under_the_limit():
    problem = small_instances(1, seed=11)[0]
    assert model_size(problem)[0] <= 200
    assert solve_miqp(problem, backend="gurobi").solver == "gurobi"


# ----------------------------------------------------------------------------- merging

def test_merge_layers_balances_compute_and_preserves_scores():
    rng = random.Random(5)
    doc = random_doc(rng, 9, 2, 2)
    doc["memory_options_bytes"] = [10_000, 20_000]
    problem = parse_problem(doc)
    merged, groups = merge_layers(problem, 4)
    assert merged.num_layers == 4 and groups[0][0] == 0 and groups[-1][1] == 8
    assert all(groups[g + 1][0] == groups[g][1] + 1 for g in range(3))
    # The groups minimise the largest group's work: no split into 4 does better.
    work = [sum(problem.forward_s[i]) / 2 + sum(problem.backward_s[i]) / 2 for i in range(9)]
    best = min(max(sum(work[a:b]) for a, b in zip((0,) + s, s + (9,)))
               for s in itertools.combinations(range(1, 9), 3))
    assert max(sum(work[a:b + 1]) for a, b in groups) == pytest.approx(best)
    # A plan on the merged problem scores the same as its expansion on the original one.
    for cuts in [(), (1,), (0, 2), (0, 1, 2)]:
        options = tuple(rng.randrange(2) for _ in range(len(cuts) + 1))
        d = problem.valid_degrees()[0]
        assert evaluate(merged, cuts, d, options) == pytest.approx(
            evaluate(problem, expand_cuts(groups, cuts), d, options))
    # Merging only removes choices.
    full, coarse = solve_exact(problem), solve_exact(merged)
    assert evaluate(merged, coarse.cuts, coarse.d, coarse.options)[2] >= \
        evaluate(problem, full.cuts, full.d, full.options)[2] * (1 - 1e-12)
    answer = co_optimize({**doc, "max_layers": 4})
    assert answer["merged_layers"] == [list(g) for g in groups]
    assert set(answer["cuts"]) <= {b for _, b in groups}


# ----------------------------------------------------------------------------- invalid input

def base_doc():
    doc = random_doc(random.Random(2), 3, 2, 2)
    for key in ("pareto", "price_per_s", "optimizer_state_factor"):
        doc.pop(key, None)
    return doc


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("layers"), "layers"),
    (lambda d: d.update(layers=[]), "layers"),
    (lambda d: d["layers"][2].update(forward_s=[1.0]), "layers[2].forward_s"),
    (lambda d: d["layers"][1]["backward_s"].__setitem__(0, -1.0), "layers[1].backward_s[0]"),
    (lambda d: d["layers"][0].update(grad_bytes=-2), "layers[0].grad_bytes"),
    (lambda d: d["layers"][0].pop("param_bytes"), "layers[0].param_bytes"),
    (lambda d: d["layers"].__setitem__(1, 7), "layers[1]"),
    (lambda d: d.update(weights=[0, 0]), "weights"),
    (lambda d: d.update(weights="cheap"), "weights"),
    (lambda d: d.update(weights=[1, -1]), "weights[1]"),
    (lambda d: d.update(dp_degrees=[]), "dp_degrees"),
    (lambda d: d.update(dp_degrees=[2, 0]), "dp_degrees[1]"),
    (lambda d: d.update(dp_degrees=[1.5]), "dp_degrees[0]"),
    (lambda d: d.update(microbatches=0), "microbatches"),
    (lambda d: d.update(contention=0.5), "contention"),
    (lambda d: d.update(latency_s=float("nan")), "latency_s"),
    (lambda d: d.update(latency_s=True), "latency_s"),
    (lambda d: d.update(bandwidth_bytes_per_s=[1.0]), "bandwidth_bytes_per_s"),
    (lambda d: d["memory_options_bytes"].__setitem__(1, 0), "memory_options_bytes[1]"),
    (lambda d: d.update(price_per_s=[1.0]), "price_per_s"),
    (lambda d: d.update(optimizer_state_factor=-1), "optimizer_state_factor"),
    (lambda d: d.update(solver="cplex"), "solver"),
    (lambda d: d.update(pareto=[[1]]), "pareto[0]"),
    (lambda d: d.update(pareto="some"), "pareto"),
    (lambda d: d.update(max_layers=0), "max_layers"),
    (lambda d: d.update(time_limit_s=-1), "time_limit_s"),
])
def test_invalid_input_names_the_field(mutate, field):
    doc = copy.deepcopy(base_doc())
    co_optimize(doc)                          # the unmutated document is valid
    mutate(doc)
    with pytest.raises(PlannerInputError) as error:
        co_optimize(doc)
    assert error.value.field == field
    assert str(error.value).startswith(field)


def test_infeasible_answers_say_why():
    doc = base_doc()
    answer = co_optimize({**doc, "dp_degrees": [4], "microbatches": 6})
    assert answer["feasible"] is False and "divides" in answer["reason"]
    answer = co_optimize({**doc, "memory_options_bytes": [1, 2]})
    assert answer["feasible"] is False and "fits" in answer["reason"]


# ----------------------------------------------------------------------------- sync dtype

INT8 = wire_bytes(1e8, "int8") / 1e8       # bytes an int8 sync moves per float32 byte


def test_evaluate_prices_the_sync_at_the_sync_bytes_factor():
    # The hand-computed plan above with a sync moving a quarter of the float32 bytes: each
    # stage's sync is 2 * 0.25 * 20 / 10 + 4 * 0.5 = 3 instead of 6, so t = 10 + max(8, 13) + 3.
    doc = HAND_DOC
    assert parse_problem(doc).sync_bytes_factor == 1.0        # absent: float32, as before
    assert evaluate(parse_problem({**doc, "sync_bytes_factor": 1.0}), [0], 2, [0, 0])[0] == pytest.approx(29.0)
    t_iter, c_iter, _ = evaluate(parse_problem({**doc, "sync_bytes_factor": 0.25}), [0], 2, [0, 0])
    assert t_iter == pytest.approx(26.0)
    assert c_iter == pytest.approx(26.0 * 2 * 2 * 1000 * 0.001)
    assert evaluate(parse_problem({**doc, "sync_bytes_factor": 0.25, "dp_degrees": [1]}), [0], 1, [0, 0]) == \
        evaluate(parse_problem({**doc, "dp_degrees": [1]}), [0], 1, [0, 0])   # one replica: no sync


MB = 1e6
FLIP_DOC = {  # float32 syncs make one replica the fastest plan; int8's make four replicas pay
    "layers": [
        {"forward_s": [0.10, 0.05], "backward_s": [0.20, 0.10], "output_bytes": 1 * MB,
         "activation_bytes": 4 * MB, "param_bytes": 40 * MB},
        {"forward_s": [0.20, 0.10], "backward_s": [0.40, 0.20], "output_bytes": 1 * MB,
         "activation_bytes": 4 * MB, "param_bytes": 40 * MB},
        {"forward_s": [0.10, 0.05], "backward_s": [0.20, 0.10], "output_bytes": 0.5 * MB,
         "activation_bytes": 2 * MB, "param_bytes": 20 * MB}],
    "memory_options_bytes": [1000 * MB, 2000 * MB], "bandwidth_bytes_per_s": [40 * MB, 40 * MB],
    "latency_s": 0.01, "contention": 1.0, "base_memory_bytes": 100 * MB, "dp_degrees": [1, 2, 4],
    "microbatches": 4, "price_per_byte_s": 1e-12, "weights": [1, 1]}


def contract_score(doc, cuts, d, options, factor):
    """(fits, t_iter, c_iter) of a plan, written out here from the co-optimize contract
    (GPipe stages, cut transfers up and down, (mu - 1) lags, each stage's sync
    2 * factor * params / W + (2 + d) * latency after its backward pass when d > 1)."""
    layers, L = doc["layers"], len(doc["layers"])
    W, lat, beta = doc["bandwidth_bytes_per_s"], doc["latency_s"], doc["contention"]
    mu = doc["microbatches"] // d
    starts, ends = [0] + [c + 1 for c in cuts], list(cuts) + [L - 1]
    fc, bc, sync, fits = [], [], [], True
    for a, b, j in zip(starts, ends, options):
        fc.append(beta * sum(layers[i]["forward_s"][j] for i in range(a, b + 1)))
        bc.append(beta * sum(layers[i]["backward_s"][j] for i in range(a, b + 1)))
        params = sum(layers[i]["param_bytes"] for i in range(a, b + 1))
        acts = sum(layers[i]["activation_bytes"] for i in range(a, b + 1))
        sync.append(2 * factor * params / W[j] + (2 + d) * lat if d > 1 else 0.0)
        need = mu * acts + (4 - (2 if d == 1 else 0)) * params + doc["base_memory_bytes"]
        fits = fits and need <= doc["memory_options_bytes"][j]
    fwd, bwd = [], []
    for s in range(len(options) - 1):
        o = layers[ends[s]]["output_bytes"]
        g = layers[ends[s] + 1].get("grad_bytes", o)
        fwd.append((o / W[options[s]] + lat, o / W[options[s + 1]] + lat))
        bwd.append((g / W[options[s + 1]] + lat, g / W[options[s]] + lat))
    t_f = sum(fc) + sum(u + v for u, v in fwd) + (mu - 1) * max(fc + [x for p in fwd for x in p])
    t_b = [sum(bc[s:]) + sum(x for p in bwd[s:] for x in p)
           + (mu - 1) * max(bc[s:] + [x for p in bwd[s:] for x in p]) + sync[s] for s in range(len(options))]
    t_iter = t_f + max(t_b)
    rate = sum(doc["price_per_byte_s"] * doc["memory_options_bytes"][j] for j in options)
    return fits, t_iter, t_iter * d * rate


def contract_optimum(doc, factor):
    """The least objective over every (cuts, d, options) that fits, by enumeration."""
    L, J = len(doc["layers"]), len(doc["memory_options_bytes"])
    a1, a2 = doc["weights"]
    best = None
    for d in doc["dp_degrees"]:
        if doc["microbatches"] % d:
            continue
        for mask in range(2 ** (L - 1)):
            cuts = tuple(i for i in range(L - 1) if mask >> i & 1)
            for options in itertools.product(range(J), repeat=len(cuts) + 1):
                fits, t_iter, c_iter = contract_score(doc, cuts, d, options, factor)
                if fits and (best is None or a1 * c_iter + a2 * t_iter < best[0]):
                    best = (a1 * c_iter + a2 * t_iter, cuts, d, options)
    return best


def test_an_int8_sync_factor_turns_the_exact_optimum_data_parallel():
    f32, int8 = contract_optimum(FLIP_DOC, 1.0), contract_optimum(FLIP_DOC, INT8)
    assert f32[2] == 1 and int8[2] > 1           # the case is what it says
    for factor, best in ((None, f32), (1.0, f32), (INT8, int8)):
        doc = FLIP_DOC if factor is None else {**FLIP_DOC, "sync_bytes_factor": factor}
        answer = co_optimize(doc)
        assert close(answer["objective"], best[0])
        assert (tuple(answer["cuts"]), answer["data_parallel"]) == best[1:3]
        assert [FLIP_DOC["memory_options_bytes"].index(m) for m in answer["stage_memory_bytes"]] == list(best[3])
    # the evaluator and the contract written out here score every plan alike
    problem = parse_problem({**FLIP_DOC, "sync_bytes_factor": INT8})
    plans, t, c = all_plans(problem)
    for plan, t_iter, c_iter in zip(plans, t, c):
        fits, want_t, want_c = contract_score(FLIP_DOC, plan.cuts, plan.d, plan.options, INT8)
        assert fits and close(t_iter, want_t) and close(c_iter, want_c)


def with_factor(problems, seed):
    """The same problems with a sync factor drawn per problem (int8's, bfloat16's, larger)."""
    rng = random.Random(seed)
    return [dataclasses.replace(p, sync_bytes_factor=rng.choice([INT8, 0.5, 3.0])) for p in problems]


@pytest.mark.parametrize("seed", range(2))
def test_the_exact_solver_matches_brute_force_with_a_sync_bytes_factor(seed):
    rng = random.Random(2000 + seed)
    checked = 0
    for _ in range(40):
        doc = random_doc(rng, rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 3))
        doc["sync_bytes_factor"] = rng.choice([INT8, 0.5, 3.0])
        problem = parse_problem(doc)
        plans, t, c = all_plans(problem)
        answer = co_optimize(doc)
        if not plans:
            assert answer["feasible"] is False
            continue
        assert close(answer["objective"], brute_best(t, c, problem.weights))
        checked += 1
    assert checked > 20


@pytest.mark.parametrize("backend", ["gurobi", "scip"])
def test_heuristic_exact_and_miqp_agree_with_a_sync_bytes_factor(backend):
    from planners.co_optimize_exact import _HEURISTIC_BEAM, _search, _Tables

    problems = with_factor(small_instances(4, seed=21), seed=22) + [
        parse_problem({**FLIP_DOC, "sync_bytes_factor": INT8})]
    for problem in problems:
        plan = solve_exact(problem)
        solved = solve_miqp(problem, backend=backend)
        assert solved.solver == backend and not solved.fallback
        if plan is None:
            assert solved.plan is None
            continue
        want = evaluate(problem, plan.cuts, plan.d, plan.options)[2]
        got = evaluate(problem, solved.plan.cuts, solved.plan.d, solved.plan.options)[2]
        assert solved.status == "optimal" and close(got, want, rel=1e-6)
        # the exact solver's beam pass: its own score of its plan is the evaluator's
        for d in problem.valid_degrees():
            found = _search(_Tables(problem, d), upper=float("inf"), beam=_HEURISTIC_BEAM)
            if found is not None:
                objective, beam_plan = found
                assert close(objective, evaluate(problem, beam_plan.cuts, d, beam_plan.options)[2], rel=1e-9)
                assert objective >= want * (1 - 1e-9)


@pytest.mark.parametrize("value", [0, -0.5, "int8", True, float("nan"), float("inf")])
def test_a_bad_sync_bytes_factor_is_refused_naming_the_field(value):
    doc = {**copy.deepcopy(base_doc()), "sync_bytes_factor": value}
    with pytest.raises(PlannerInputError) as error:
        co_optimize(doc)
    assert error.value.field == "sync_bytes_factor" and "\n" not in str(error.value)
    with pytest.raises(PlannerInputError, match="^sync_bytes_factor: "):
        dataclasses.replace(parse_problem(base_doc()), sync_bytes_factor=value)


def test_the_command_line_refuses_a_bad_sync_bytes_factor_in_one_line(tmp_path):
    import io

    from planners.cli import run

    path = tmp_path / "doc.json"
    path.write_text(json.dumps({**base_doc(), "sync_bytes_factor": 0}))
    out, err = io.StringIO(), io.StringIO()
    assert run(["co-optimize", str(path)], stdout=out, stderr=err) == 2
    assert err.getvalue().startswith("sync_bytes_factor: ") and err.getvalue().count("\n") == 1
    path.write_text(json.dumps({**base_doc(), "sync_bytes_factor": INT8}))
    assert run(["co-optimize", str(path)], stdout=out, stderr=err) == 0

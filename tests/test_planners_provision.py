"""Cynthia provisioning against brute force, the model by hand, and the loss-curve fit."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from core.errors import PlannerInputError
from planners.worker_count import evaluate, fit_loss_curve, parse_provision, plan_provision, provision


def random_doc(rng: random.Random, *, max_workers: int | None) -> dict:
    """A provision document over 1-3 types; deadlines span infeasible to loose."""
    doc = {
        "mode": rng.choice(["BSP", "ASP"]),
        "w_iter_flops": rng.uniform(1, 100) * 1e9,
        "g_param_bytes": rng.uniform(1, 50) * 1e6,
        "c_prof_flops": rng.uniform(0.1, 5) * 1e9,
        "b_prof_bytes_per_s": rng.uniform(1, 100) * 1e6,
        "c_base_flops": rng.uniform(1, 10) * 1e9,
        "loss_model": {"beta0": rng.uniform(10, 1000), "beta1": rng.uniform(-5, 50)},
        "target_loss": rng.uniform(0.05, 1.0),
        "deadline_s": 10 ** rng.uniform(2, 5),
        "instance_types": [{"name": f"type{i}", "cpu_flops": rng.uniform(1, 10) * 1e9,
                            "bandwidth_bytes_per_s": rng.uniform(1, 100) * 1e6,
                            "price_per_hour": rng.uniform(0.05, 2.0)}
                           for i in range(rng.randint(1, 3))],
    }
    if max_workers is not None:
        doc["max_workers"] = max_workers
    return doc


def brute_force(doc: dict):
    """The least cost over every type, n_wk and n_ps by plain loops (None if infeasible)."""
    problem = parse_provision(doc)
    best = None
    for kind in problem.instance_types:
        for n_wk in range(1, problem.max_workers + 1):
            for n_ps in range(1, n_wk + 1):
                plan = evaluate(problem, kind, n_wk, n_ps)
                if plan.time_s <= problem.deadline_s and (best is None or plan.cost < best.cost):
                    best = plan
    return best


def check(doc: dict) -> bool:
    """Compare with brute force; True when the instance is feasible."""
    answer = provision(doc)
    expected = brute_force(doc)
    if expected is None:
        assert answer["feasible"] is False and "deadline_s" in answer["reason"]
        return False
    assert answer["feasible"] is True
    assert answer["cost"] == pytest.approx(expected.cost, rel=1e-9)
    assert answer["time_s"] <= doc["deadline_s"]
    assert 1 <= answer["parameter_servers"] <= answer["workers"] <= doc.get("max_workers", 256)
    # the reported numbers are the model's for the reported plan
    problem = parse_provision(doc)
    kind = next(k for k in problem.instance_types if k.name == answer["instance_type"])
    again = evaluate(problem, kind, answer["workers"], answer["parameter_servers"])
    assert again.to_dict() == answer
    return True


def test_random_instances_match_brute_force():
    rng = random.Random(2024)
    outcomes = [check(random_doc(rng, max_workers=rng.randint(1, 14))) for _ in range(240)]
    assert 20 < sum(outcomes) < 220  # both feasible and infeasible instances occur


def test_default_max_workers_is_256():
    rng = random.Random(8)
    doc = random_doc(rng, max_workers=None)
    doc.update(mode="BSP", deadline_s=1e5, instance_types=doc["instance_types"][:1])
    assert check(doc)
    assert parse_provision(doc).max_workers == 256


def test_model_by_hand():
    doc = {"mode": "BSP", "w_iter_flops": 8e9, "g_param_bytes": 1e6, "c_prof_flops": 1e9,
           "b_prof_bytes_per_s": 1e7, "c_base_flops": 4e9,
           "loss_model": {"beta0": 10, "beta1": 1}, "target_loss": 0.5, "deadline_s": 1e9,
           "instance_types": [{"name": "m", "cpu_flops": 4e9, "bandwidth_bytes_per_s": 1e8,
                               "price_per_hour": 3.6}]}
    problem = parse_provision(doc)
    kind = problem.instance_types[0]
    # 4 workers, 1 PS: s = ceil(10 / 0.5 - 1) = 19; r_scale = 4, c_d = 4e9 <= c_s = 4e9,
    # b_d = 4e7 <= 1e8, so u = 1: t_comp = 8e9 / 16e9 = 0.5, t_comm = 2e6 * 4 / 1e8 = 0.08
    plan = evaluate(problem, kind, 4, 1)
    assert (plan.iterations, plan.t_iter_s) == (19, pytest.approx(0.5))
    assert plan.cost == pytest.approx(5 * 0.001 * 19 * 0.5)
    # 8 workers, 1 PS: CPU demand 8e9 against 4e9 supply, u = 0.5: t_comp = 8e9 / (32e9 * 0.5)
    assert evaluate(problem, kind, 8, 1).t_iter_s == pytest.approx(0.5)
    # ASP, 4 workers: s = ceil(10 / (0.5 * 2) - 1 / 4) = 10; t = 8e9 / 4e9 + 2e6 / 1e8
    asp = parse_provision({**doc, "mode": "ASP"})
    plan = evaluate(asp, kind, 4, 2)
    assert (plan.iterations, plan.t_iter_s) == (10, pytest.approx(2.0 + 0.01))


def test_stopping_at_the_first_feasible_count_is_not_the_minimum():
    # Cynthia's scan stops at the first feasible worker count (with its minimum PS count);
    # on these instances that first plan often costs more than the true minimum.
    rng = random.Random(31)
    beaten = 0
    for _ in range(60):
        doc = random_doc(rng, max_workers=16)
        doc["mode"] = "BSP"
        best = brute_force(doc)
        if best is None:
            continue
        answer = provision(doc)
        assert answer["cost"] == pytest.approx(best.cost, rel=1e-9)
        problem = parse_provision(doc)
        for kind in problem.instance_types:
            for n_wk in range(1, 17):
                first = evaluate(problem, kind, n_wk, 1)
                if first.time_s <= problem.deadline_s:
                    beaten += first.cost > best.cost * (1 + 1e-9)
                    break
    assert beaten > 0


def test_fit_loss_curve_recovers_exact_curves():
    s = np.arange(10, 3000, 15, dtype=float)
    bsp = fit_loss_curve(zip(s, 150 / (s + 7)))
    assert (bsp.beta0, bsp.beta1) == (pytest.approx(150, rel=1e-6), pytest.approx(7, rel=1e-5))
    asp = fit_loss_curve(zip(s, 80 * math.sqrt(4) / (s - 3)), workers=4)
    assert (asp.beta0, asp.beta1) == (pytest.approx(80, rel=1e-6), pytest.approx(-3, rel=1e-5))


def test_fit_loss_curve_is_least_squares():
    rng = random.Random(4)
    s = np.arange(5, 800, 9, dtype=float)
    loss = 40 / (s + 12) * (1 + 0.05 * np.array([rng.uniform(-1, 1) for _ in s]))
    fit = fit_loss_curve(zip(s, loss))

    def sse(b0, b1):
        return float(np.sum((loss - b0 / (s + b1)) ** 2))
    base = sse(fit.beta0, fit.beta1)
    for d0 in (-0.01, 0, 0.01):
        for d1 in (-0.01, 0, 0.01):
            assert sse(fit.beta0 * (1 + d0), fit.beta1 + d1 * 12) >= base * (1 - 1e-9)


@pytest.mark.parametrize("points, field", [
    ([(1, 0.5)], "points"),
    ([(1, 0.5), (1, 0.4)], "points"),
    ([(1, 0.5), (2, -0.4)], "points[1]"),
    ([(1, 0.5), (math.inf, 0.4)], "points[1]"),
    ([(1, 0.5), ("a", 0.4)], "points[1]"),
])
def test_fit_loss_curve_refuses_bad_points(points, field):
    with pytest.raises(PlannerInputError) as err:
        fit_loss_curve(points)
    assert err.value.field == field


def test_full_search_of_three_types_and_256_workers_is_batched(monkeypatch):
    """What keeps the full search fast, asserted instead of timed: every (type, n_wk, n_ps)
    pair with 1 <= n_ps <= n_wk <= 256 is scored, in one array call per type (not one call
    per pair)."""
    import planners.worker_count as provision_module

    rng = random.Random(12)
    doc = random_doc(rng, max_workers=256)
    doc["instance_types"] = [{"name": f"t{i}", "cpu_flops": (i + 1) * 2e9,
                              "bandwidth_bytes_per_s": (i + 1) * 3e7, "price_per_hour": 0.1 + i}
                             for i in range(3)]
    doc["deadline_s"] = 1e7
    calls, real_time = [], provision_module.iteration_time

    def counted(problem, kind, workers, servers):
        calls.append((kind.name, int(np.size(workers))))
        return real_time(problem, kind, workers, servers)

    monkeypatch.setattr(provision_module, "iteration_time", counted)
    assert provision(doc)["feasible"] is True
    search = [c for c in calls if c[1] > 1]  # the search's array calls (the chosen plan is rescored alone)
    assert search == [(f"t{i}", 256 * 257 // 2) for i in range(3)]
    assert plan_provision(parse_provision(doc)) is not None

"""Hybrid D x M selection against brute force, the joint sync choice, and the alpha/beta fit."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from core.errors import PlannerInputError
from core.stage_memory import stage_bounds
from planners.hybrid import fit_allreduce, hybrid, hybrid_time, microbatches_per_replica, parse_hybrid
from planners.partition import pipeline_runtime
from planners.sync_time import ring_allreduce


def random_doc(rng: random.Random) -> dict:
    """A hybrid document; optional fields (sync, transport, latency_s) at random."""
    n = rng.randint(1, 7)
    doc = {
        "layers": [{"forward_s": rng.random(), "backward_s": 2 * rng.random(),
                    "output_bytes": rng.randint(0, 3000),
                    "param_bytes": rng.choice([0, rng.randint(1, 20000)])} for _ in range(n)],
        "bandwidth_bytes_per_s": rng.choice([1000.0, 10000.0]),
        "max_stages": rng.randint(1, 8),
        "cluster_size": rng.randint(1, 10),
        "global_batch": rng.choice([7, 8, 12, 16, 24, 30, 64]),
        "microbatch_size": rng.choice([1, 2, 3, 4, 8]),
        "allreduce": {"alpha_s_per_byte": rng.choice([0.0, 1e-5]), "beta_s": rng.choice([0.0, 0.02])},
    }
    if rng.random() < 0.5:
        doc["microbatches"] = rng.choice([99, 0, "many"])  # ignored by hybrid
    if rng.random() < 0.7:
        doc["sync"] = rng.choice(["ring", "scatter_reduce", "pipelined_scatter_reduce"])
    if rng.random() < 0.5:
        doc["transport"] = rng.choice(["direct", "store"])
    if rng.random() < 0.5:
        doc["latency_s"] = rng.choice([0.0, 0.02])
    return doc


def brute_force(doc: dict) -> dict[tuple[int, int], float]:
    """Least T per (A, B) by enumerating every partition."""
    problem = parse_hybrid(doc)
    n = len(problem.pipeline.layers)
    best = {}
    for a in range(1, problem.cluster_size + 1):
        if microbatches_per_replica(problem, a) is None:
            continue
        for b in range(1, min(problem.cluster_size // a, n, problem.pipeline.max_stages) + 1):
            best[(a, b)] = min(hybrid_time(problem, a, cuts)
                               for cuts in itertools.combinations(range(n - 1), b - 1))
    return best


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def test_random_instances_match_brute_force():
    rng = random.Random(99)
    infeasible = 0
    for _ in range(220):
        doc = random_doc(rng)
        answer = hybrid(doc)
        expected = brute_force(doc)
        if not expected:
            infeasible += 1
            assert answer["feasible"] is False and "global_batch" in answer["reason"]
            continue
        got = {(c["data_parallel"], c["stages"]): c for c in answer["candidates"]}
        assert sorted(got) == sorted(expected)
        for key, cand in got.items():
            assert close(cand["time_s"], expected[key])
            assert cand["throughput"] == pytest.approx(doc["global_batch"] / cand["time_s"])
            assert cand["microbatches"] * key[0] * doc["microbatch_size"] == doc["global_batch"]
        assert close(answer["time_s"], min(expected.values()))
        assert answer["data_parallel"] * answer["stages"] <= doc["cluster_size"]
    assert infeasible > 5  # the generator does produce batches no A divides


def test_partition_is_chosen_jointly_with_its_sync():
    # The pipeline alone prefers the cut after layer 1 (bottleneck 2 instead of 2.1), but
    # that stage holds 200 of the parameter bytes; the cut after layer 0 halves the sync.
    doc = {"layers": [{"forward_s": 1, "backward_s": 1, "output_bytes": 0, "param_bytes": 100},
                      {"forward_s": 1, "backward_s": 1, "output_bytes": 0, "param_bytes": 100},
                      {"forward_s": 1.1, "backward_s": 1.1, "output_bytes": 0, "param_bytes": 0}],
           "bandwidth_bytes_per_s": 10.0, "max_stages": 2, "cluster_size": 4,
           "global_batch": 8, "microbatch_size": 1,
           "allreduce": {"alpha_s_per_byte": 0.0, "beta_s": 0.0}}
    problem = parse_hybrid(doc)
    assert pipeline_runtime(problem.pipeline, [1], 4) < pipeline_runtime(problem.pipeline, [0], 4)
    answer = hybrid(doc)
    two_by_two = next(c for c in answer["candidates"]
                      if c["data_parallel"] == 2 and c["stages"] == 2)
    assert two_by_two["cuts"] == [0]
    # runtime 6.2 + 3 * (2.1 + 2.1), ring of 2 over 100 bytes at 10 B/s: 2 * 1 * 100 / 20
    assert two_by_two["time_s"] == pytest.approx(6.2 + 3 * 4.2 + 10.0)


def test_ring_time_formula_and_stage_maximum():
    doc = {"layers": [{"forward_s": 1, "backward_s": 2, "output_bytes": 0, "param_bytes": 300},
                      {"forward_s": 1, "backward_s": 2, "output_bytes": 0, "param_bytes": 900}],
           "bandwidth_bytes_per_s": 100.0, "max_stages": 2, "cluster_size": 6,
           "global_batch": 6, "microbatch_size": 1,
           "allreduce": {"alpha_s_per_byte": 0.001, "beta_s": 0.5}}
    problem = parse_hybrid(doc)
    # A = 3, B = 2, M = 2: pipeline 6 + 1 * (1 + 2) = 9; slowest stage 900 bytes:
    # 2 * 2 * (300 / 100 + 0.001 * 300 + 0.5) = 15.2
    assert hybrid_time(problem, 3, [0]) == pytest.approx(9 + 15.2)
    assert ring_allreduce(900, 3, 100.0, 0.001, 0.5) == pytest.approx(15.2)
    assert ring_allreduce(900, 1, 100.0, 0.001, 0.5) == 0.0


def test_fit_allreduce_recovers_alpha_beta():
    rng = random.Random(1)
    alpha, beta, bw = 2e-9, 0.003, 5e8
    samples = [(p, a, ring_allreduce(p, a, bw, alpha, beta))
               for p in (1e6, 8e6, 6.4e7) for a in (2, 4, 8)]
    fit = fit_allreduce(samples, bw)
    assert fit.alpha_s_per_byte == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_s == pytest.approx(beta, rel=1e-9)
    assert fit.rmse_s == pytest.approx(0.0, abs=1e-12)
    # without the bandwidth, alpha absorbs the transfer time (both multiply P / A)
    merged = fit_allreduce(samples)
    assert merged.alpha_s_per_byte == pytest.approx(alpha + 1 / bw, rel=1e-9)
    # with noise: the answer is the least-squares one (no perturbation does better)
    noisy = [(p, a, t * (1 + 0.05 * rng.uniform(-1, 1))) for p, a, t in samples]
    fit = fit_allreduce(noisy, bw)

    def sse(al, be):
        return sum((ring_allreduce(p, a, bw, al, be) - t) ** 2 for p, a, t in noisy)
    base = sse(fit.alpha_s_per_byte, fit.beta_s)
    for da, db in itertools.product((-1e-11, 0, 1e-11), (-1e-5, 0, 1e-5)):
        assert sse(max(0.0, fit.alpha_s_per_byte + da), max(0.0, fit.beta_s + db)) >= base - 1e-15


def test_fit_allreduce_never_negative():
    # times that fall with size would need alpha < 0: the constrained optimum sets it to 0
    samples = [(1e6, 2, 0.5), (1e7, 2, 0.4), (1e8, 4, 0.9)]
    fit = fit_allreduce(samples)
    assert fit.alpha_s_per_byte >= 0 and fit.beta_s >= 0
    x = np.array([[2 * (a - 1) * p / a, 2 * (a - 1)] for p, a, _ in samples])
    y = np.array([t for *_, t in samples])
    grid = [(al, be) for al in np.linspace(0, 1e-8, 41) for be in np.linspace(0, 0.3, 61)]
    best_grid = min(float(np.sum((x @ np.array(g) - y) ** 2)) for g in grid)
    got = float(np.sum((x @ np.array([fit.alpha_s_per_byte, fit.beta_s]) - y) ** 2))
    assert got <= best_grid + 1e-12


@pytest.mark.parametrize("samples, field", [
    ([(1e6, 1, 0.1), (2e6, 1, 0.2)], "samples"),           # no sample with two workers
    ([(1e6, 2, 0.1), (1e6, 2, 0.2)], "samples"),           # one size only
    ([(1e6, 2, 0.1), ("x", 2, 0.1)], "samples[1]"),
    ([(1e6, 2, 0.1), (1e6, 0, 0.1)], "samples[1]"),
    ([(1e6, 2, math.nan), (1e6, 4, 0.1)], "samples[0]"),
])
def test_fit_allreduce_refuses_bad_samples(samples, field):
    with pytest.raises(PlannerInputError) as err:
        fit_allreduce(samples)
    assert err.value.field == field


def test_stage_bounds_cover_the_chain():
    assert stage_bounds([c + 1 for c in [1, 3]], 6) == [(0, 1), (2, 3), (4, 5)]  # cuts after layers 1, 3
    assert stage_bounds([], 3) == [(0, 2)]

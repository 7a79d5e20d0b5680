"""The exact partition planner against brute-force enumeration, and the micro-batch search."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from planners.bottleneck_partition import solve_chain
from planners.partition import (LayerMemoryProfile, PartitionProblem, PipelineLayer, parse_partition,
                                partition, pipeline_runtime, plan_partition, runtime_terms,
                                search_microbatching, stage_memory_fits)


def random_doc(rng: random.Random, n_layers: int, *, heavy: bool = False) -> dict:
    """A partition document; optional fields (transport, latency_s, name) present at random."""
    def draw():
        return rng.paretovariate(1.2) if heavy else rng.choice([0.0, rng.random()])
    doc = {
        "layers": [{"forward_s": draw(), "backward_s": 2 * draw(),
                    "output_bytes": rng.choice([0, rng.randint(1, 5000)])}
                   for _ in range(n_layers)],
        "bandwidth_bytes_per_s": rng.choice([500.0, 5000.0, 50000.0]),
        "microbatches": rng.choice([1, 2, 4, 7, 32]),
        "max_stages": rng.randint(1, n_layers + 2),
    }
    if rng.random() < 0.6:
        doc["transport"] = rng.choice(["direct", "store"])
    if rng.random() < 0.6:
        doc["latency_s"] = rng.choice([0.0, 0.01, 0.3])
    if rng.random() < 0.3:
        doc["layers"][0]["name"] = "conv1"
    return doc


def brute_force(problem: PartitionProblem, allowed=None) -> dict[int, float]:
    """Least runtime per stage count by enumerating every set of cuts."""
    n = len(problem.layers)
    best: dict[int, float] = {}
    for k in range(1, min(problem.max_stages, n) + 1):
        for cuts in itertools.combinations(range(n - 1), k - 1):
            if allowed is not None:
                starts, ends = [0] + [c + 1 for c in cuts], list(cuts) + [n - 1]
                if not all(allowed[a, b] for a, b in zip(starts, ends)):
                    continue
            rt = pipeline_runtime(problem, cuts)
            best[k] = min(best.get(k, np.inf), rt)
    return best


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def check_against_brute_force(doc: dict) -> None:
    answer = partition(doc)
    problem = parse_partition(doc)
    expected = brute_force(problem)
    assert sorted(int(k) for k in answer["by_stages"]) == sorted(expected)
    for k, got in answer["by_stages"].items():
        assert got["stages"] == int(k) == len(got["cuts"]) + 1
        assert got["cuts"] == sorted(set(got["cuts"]))
        assert close(got["runtime_s"], expected[int(k)])
        assert close(pipeline_runtime(problem, got["cuts"]), got["runtime_s"])
    assert close(answer["best"]["runtime_s"], min(expected.values()))


def test_small_instances_match_brute_force():
    rng = random.Random(20240601)
    for _ in range(250):
        check_against_brute_force(random_doc(rng, rng.randint(1, 9)))


def test_larger_and_heavy_tailed_instances_match_brute_force():
    # 13-14 layers exercise the bounds and floors; heavy tails make one layer the bottleneck
    rng = random.Random(7)
    for i in range(24):
        doc = random_doc(rng, rng.randint(12, 14), heavy=i % 2 == 0)
        doc["max_stages"] = rng.randint(3, 6)
        doc["microbatches"] = rng.choice([2, 8, 64])
        check_against_brute_force(doc)


def test_hand_computed_runtime():
    doc = {"layers": [{"forward_s": 1, "backward_s": 2, "output_bytes": 10}] * 2,
           "bandwidth_bytes_per_s": 100, "microbatches": 4, "max_stages": 2}
    answer = partition(doc)
    # one stage: M (F + B) = 4 * 6; two: 6 + 2 * 0.1 + 3 * (1 + 2)
    assert answer["by_stages"]["1"] == {"cuts": [], "stages": 1, "runtime_s": 24.0}
    assert answer["by_stages"]["2"]["cuts"] == [0]
    assert answer["by_stages"]["2"]["runtime_s"] == pytest.approx(15.2)
    assert answer["best"]["stages"] == 2
    # the store hop is an upload and a download: 6 + 2 * 0.2 + 3 * (1 + 2)
    store = partition({**doc, "transport": "store"})
    assert store["by_stages"]["2"]["runtime_s"] == pytest.approx(15.4)


def test_exact_where_a_communication_first_dp_is_not():
    # Minimising communication first picks the cheap cut after layer 1, which leaves the
    # stages unbalanced; the exact answer pays more communication for a smaller bottleneck.
    doc = {"layers": [{"forward_s": 1, "backward_s": 1, "output_bytes": 100},
                      {"forward_s": 1, "backward_s": 1, "output_bytes": 1},
                      {"forward_s": 1, "backward_s": 1, "output_bytes": 100},
                      {"forward_s": 5, "backward_s": 5, "output_bytes": 0}],
           "bandwidth_bytes_per_s": 100, "microbatches": 16, "max_stages": 2}
    answer = partition(doc)
    assert answer["by_stages"]["2"]["cuts"] == [2]
    # 16 + 2 * 1 + 15 * (5 + 5) against 16 + 2 * 0.01 + 15 * (6 + 6)
    assert answer["by_stages"]["2"]["runtime_s"] == pytest.approx(168.0)


def test_memory_limited_stages_match_brute_force():
    rng = random.Random(11)
    for _ in range(40):
        n = rng.randint(2, 8)
        profiles = [LayerMemoryProfile(forward_s_per_sample=rng.random(),
                                       backward_s_per_sample=rng.random(),
                                       output_bytes_per_sample=rng.randint(0, 100),
                                       activation_bytes_per_sample=rng.randint(1, 50),
                                       resident_bytes=rng.randint(0, 400)) for _ in range(n)]
        allowed = stage_memory_fits(profiles, 2, 3, memory_bytes=rng.randint(300, 1500))
        problem = PartitionProblem(
            layers=tuple(PipelineLayer(forward_s=rng.random(), backward_s=rng.random(),
                                       output_bytes=rng.randint(0, 100)) for _ in range(n)),
            bandwidth_bytes_per_s=50.0, microbatches=3, max_stages=rng.randint(1, n))
        expected = brute_force(problem, allowed)
        got = plan_partition(problem, allowed=allowed)
        assert sorted(got) == sorted(expected)
        for k, result in got.items():
            assert close(result.runtime_s, expected[k])


def test_microbatch_search_follows_hydrozoa_and_is_exact_per_pair():
    rng = random.Random(5)
    for _ in range(25):
        n = rng.randint(2, 6)
        profiles = [LayerMemoryProfile(forward_s_per_sample=rng.uniform(0.01, 0.1),
                                       backward_s_per_sample=rng.uniform(0.01, 0.2),
                                       output_bytes_per_sample=rng.randint(1, 100),
                                       activation_bytes_per_sample=rng.randint(1, 20),
                                       resident_bytes=rng.randint(0, 200),
                                       forward_fixed_s=rng.choice([0.0, 0.01]))
                    for _ in range(n)]
        memory, stages = rng.randint(250, 2000), rng.randint(1, n)
        plan = search_microbatching(profiles, memory_bytes=memory, bandwidth_bytes_per_s=1000.0,
                                    max_stages=stages, max_microbatches=40, latency_s=0.001)
        # every size tried is a power of two that fits with one micro-batch, in order,
        # and its count is the largest that some partition into <= stages can hold
        sizes = [size for size, _, _ in plan.considered] if plan else []
        assert sizes == [2 ** i for i in range(len(sizes))]
        for size, count, throughput in (plan.considered if plan else ()):
            fits = [m for m in range(1, 41) if _fits(profiles, size, m, memory, stages)]
            assert count == max(fits)
        next_size = 2 ** len(sizes)
        assert not _fits(profiles, next_size, 1, memory, stages)
        if plan:
            assert plan.throughput == max(t for _, _, t in plan.considered)
            problem = PartitionProblem(
                layers=tuple(PipelineLayer(
                    forward_s=p.forward_fixed_s + p.forward_s_per_sample * plan.microbatch_size,
                    backward_s=p.backward_fixed_s + p.backward_s_per_sample * plan.microbatch_size,
                    output_bytes=p.output_bytes_per_sample * plan.microbatch_size)
                    for p in profiles),
                bandwidth_bytes_per_s=1000.0, microbatches=plan.microbatches,
                max_stages=stages, latency_s=0.001)
            allowed = stage_memory_fits(profiles, plan.microbatch_size, plan.microbatches, memory)
            assert close(plan.partition.runtime_s, min(brute_force(problem, allowed).values()))


def _fits(profiles, size, count, memory, stages) -> bool:
    """Brute force: some partition into <= stages stages fits in memory."""
    n = len(profiles)
    allowed = stage_memory_fits(profiles, size, count, memory)
    for k in range(1, min(stages, n) + 1):
        for cuts in itertools.combinations(range(n - 1), k - 1):
            starts, ends = [0] + [c + 1 for c in cuts], list(cuts) + [n - 1]
            if all(allowed[a, b] for a, b in zip(starts, ends)):
                return True
    return False


def test_128_layers_16_stages_each_stage_count_at_its_optimum():
    """A large instance (its solve time is a benchmark's figure: benchmarks/bench_planners.py,
    128 layers into up to 16 stages): every stage count gets valid cuts whose runtime is the one
    reported, and the two- and three-stage answers are the optima by enumeration."""
    rng = random.Random(3)
    doc = {"layers": [{"forward_s": rng.random(), "backward_s": 2 * rng.random(),
                       "output_bytes": rng.randint(0, 10 ** 6)} for _ in range(128)],
           "bandwidth_bytes_per_s": 1e7, "microbatches": 8, "max_stages": 16}
    answer = partition(doc)
    problem = parse_partition(doc)
    assert sorted(int(k) for k in answer["by_stages"]) == list(range(1, 17))
    for k, r in answer["by_stages"].items():
        cuts = r["cuts"]
        assert len(cuts) == int(k) - 1 and cuts == sorted(set(cuts)) and all(0 <= c < 127 for c in cuts)
        assert r["runtime_s"] == pytest.approx(pipeline_runtime(problem, cuts))
    two = min(pipeline_runtime(problem, (c,)) for c in range(127))
    three = min(pipeline_runtime(problem, cuts) for cuts in itertools.combinations(range(127), 2))
    assert answer["by_stages"]["2"]["runtime_s"] == pytest.approx(two)
    assert answer["by_stages"]["3"]["runtime_s"] == pytest.approx(three)


def test_dominance_alone_is_exact():
    # The solver prunes by bounds and by dominance; each alone must keep the optimum, so
    # check the dominance DP without the bounds against brute force as well.
    rng = random.Random(77)
    for _ in range(200):
        doc = random_doc(rng, rng.randint(2, 11), heavy=rng.random() < 0.3)
        doc["microbatches"] = rng.choice([2, 3, 8])
        problem = parse_partition(doc)
        parts = runtime_terms(problem)
        found = solve_chain(cut_values=parts["cut_values"], comm_weight=parts["comm_weight"],
                            terms=parts["terms"], max_stages=problem.max_stages,
                            use_bounds=False)
        expected = brute_force(problem)
        assert sorted(found) == sorted(expected)
        for k, sol in found.items():
            assert close(pipeline_runtime(problem, sol.cuts), expected[k])

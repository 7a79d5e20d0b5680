"""The co-optimiser in the plan step: several worker sizes -> the exact (cuts, sizes, D)
choice under the job's budget or deadline; one size -> today's plan and the reason why.
Pure: a synthetic profile, a context without a server, the run prediction left out."""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
from types import SimpleNamespace

import pytest

from blocks.compute import ComputeTarget
from coordinator.run.job import TrainJob
from core.errors import ZooidValueError
from core.plan import Plan
from core.stage_memory import GB
from planners.catalog import get_offer
from planners.co_optimize import evaluate
from planners.co_optimize_flow import Point
from planners.co_optimize_problem import CoOptProblem, CoOptSolution, plan_fits

MB = float(1 << 20)
LAYERS = [  # per micro-batch of 4 rows (the profile's micro-batch): seconds, bytes
    dict(forward_s=0.20, backward_s=0.40, output_bytes=2 * MB, param_bytes=40 * MB, activation_bytes=30 * MB),
    dict(forward_s=0.10, backward_s=0.20, output_bytes=1 * MB, param_bytes=20 * MB, activation_bytes=20 * MB),
    dict(forward_s=0.30, backward_s=0.50, output_bytes=1 * MB, param_bytes=60 * MB, activation_bytes=40 * MB),
    dict(forward_s=0.05, backward_s=0.10, output_bytes=0.1 * MB, param_bytes=5 * MB, activation_bytes=5 * MB),
]
BANDWIDTH, LATENCY, BASE, SERIAL = 50 * MB, 0.02, 200 * MB, 0.2


def profile(layers=LAYERS) -> dict:
    return {"model": "synthetic", "input_shape": [8], "batch_size": 8, "microbatch_size": 4, "step_s": 2.0,
            "param_bytes": sum(l["param_bytes"] for l in layers), "peak_rss_bytes": 0,
            "layers": [{"name": f"l{i}", **l} for i, l in enumerate(layers)],
            "store_bandwidth_bytes_per_s": BANDWIDTH, "store_latency_s": LATENCY, "base_memory_bytes": BASE,
            "serial_fraction": SERIAL, "contention": 1.0}


def context(job: TrainJob, target: ComputeTarget, n_train: int = 64):
    offer = get_offer(target.offer)
    return SimpleNamespace(job=job, resolved=SimpleNamespace(target=target, offer=offer, n_train=n_train,
                                                             shared_parameters=()),
                           price_per_worker_s=offer.price_per_s(target.worker_vcpu, target.worker_memory_gb,
                                                                target.worker_gpu))


@pytest.fixture(autouse=True)
def no_run_prediction(monkeypatch):
    import coordinator.plan.planning

    monkeypatch.setattr(coordinator.plan.planning, "with_run", lambda ctx, chosen, calibration, epochs_left, **kw: chosen)


def make(job: TrainJob, target: ComputeTarget, layers=LAYERS) -> Plan:
    from coordinator.plan.planning import make_plan

    return make_plan(context(job, target), profile(layers), job.workers)


def brute_points(job: TrainJob, target: ComputeTarget, layers=LAYERS) -> tuple[CoOptProblem, list[Point]]:
    """Every (cuts, sizes, D) the job's worker budget allows that fits, scored by `evaluate`,
    the problem written out here from the profile and the catalog (function offer: vCPU in
    proportion to memory, Amdahl with the profile's serial fraction)."""
    offer, sizes = get_offer(target.offer), target.memory_options()
    vcpu = [offer.vcpu * g / offer.memory_gb if offer.kind == "function" else target.worker_vcpu for g in sizes]
    ref = offer.vcpu * target.worker_memory_gb / offer.memory_gb if offer.kind == "function" else target.worker_vcpu
    amdahl = lambda v: 1 / v if v < 1 else SERIAL + (1 - SERIAL) / v
    factor = [amdahl(v) / amdahl(ref) for v in vcpu]
    mb = job.microbatches
    total = (1 if job.strategy == "pipeline" else job.workers) * mb
    problem = CoOptProblem(
        forward_s=tuple(tuple(l["forward_s"] * f for f in factor) for l in layers),
        backward_s=tuple(tuple(l["backward_s"] * f for f in factor) for l in layers),
        output_bytes=tuple(l["output_bytes"] for l in layers),
        activation_bytes=tuple(l["activation_bytes"] for l in layers),
        param_bytes=tuple(l["param_bytes"] for l in layers),
        grad_bytes=(0.0,) + tuple(l["output_bytes"] for l in layers[:-1]),
        memory_options_bytes=tuple(g * GB for g in sizes), bandwidth_bytes_per_s=(BANDWIDTH,) * len(sizes),
        latency_s=LATENCY, contention=1.0, base_memory_bytes=BASE, dp_degrees=tuple(range(1, job.workers + 1)),
        microbatches=total, price_per_byte_s=0.0, weights=(1.0, 1.0),
        price_per_s=tuple(offer.price_per_s(v, g, 0) for v, g in zip(vcpu, sizes)),
        optimizer_state_factor={"sgd": 0, "momentum": 1, "adam": 2}[job.optimizer])
    L, points = len(layers), []
    degrees = {"pipeline": [1], "hybrid": [job.workers]}.get(job.strategy, problem.valid_degrees())
    for d in degrees:
        for mask in range(2 ** (L - 1)):
            cuts = tuple(i for i in range(L - 1) if mask >> i & 1)
            k = len(cuts) + 1
            if k < 2 or (job.stages and k != job.stages) or (job.strategy == "auto" and d * k > job.workers):
                continue
            for options in itertools.product(range(len(sizes)), repeat=k):
                s = CoOptSolution(cuts, d, options)
                if plan_fits(problem, s):
                    t, c, _ = evaluate(problem, cuts, d, options)
                    points.append(Point(t, c, s))
    return problem, points


def iterations(job: TrainJob, n_train: int = 64) -> int:
    total = (1 if job.strategy == "pipeline" else job.workers) * job.batch_size
    return math.ceil(n_train / total) * job.epochs


def brute_force_optimum(points: list[Point]) -> Point:
    """The rule without a budget or a deadline, written out here rather than the planner's
    `select`: among the points within 5 % of the fastest iteration, the cheapest (then the
    faster)."""
    fastest = min(p.t_iter_s for p in points)
    near = [p for p in points if p.t_iter_s <= fastest * 1.05]
    return sorted(near, key=lambda p: (p.c_iter, p.t_iter_s))[0]


def assert_same_choice(plan: Plan, problem: CoOptProblem, best: Point):
    """The plan's (cuts, per-stage sizes, D) scores as the brute-force optimum."""
    sizes = [problem.memory_options_bytes.index(g * GB) for g in plan.stage_memory_gb]
    t, c, _ = evaluate(problem, plan.cuts, plan.data_parallel, sizes)
    assert t == pytest.approx(best.t_iter_s, rel=1e-9) and c == pytest.approx(best.c_iter, rel=1e-9)


LAMBDA = dict(kind="aci", offer="lambda-10gb", worker_vcpu=1.0, worker_memory_gb=2.0,
              worker_memory_options_gb=[1.0, 2.0, 4.0, 8.0])


@pytest.mark.parametrize("strategy,workers", [("pipeline", 1), ("auto", 4), ("hybrid", 2)])
def test_plan_equals_the_brute_force_optimum_over_cuts_sizes_and_degree(strategy, workers):
    job = TrainJob(strategy=strategy, workers=workers, max_workers=8, batch_size=8, microbatches=2, epochs=2)
    target = ComputeTarget(**LAMBDA)
    plan = make(job, target)
    assert plan.co_optimizer["used"], plan.co_optimizer
    problem, points = brute_points(job, target)
    best = brute_force_optimum(points)
    assert_same_choice(plan, problem, best)
    assert plan.worker_memory_gb == max(plan.stage_memory_gb) and len(plan.stage_memory_gb) == plan.stages
    assert plan.price_per_worker_s == pytest.approx(get_offer("lambda-10gb").price_per_s(memory_gb=plan.worker_memory_gb))
    co = plan.co_optimizer
    assert co["sizes_gb"] == [1.0, 2.0, 4.0, 8.0] and [u["memory_gb"] for u in co["uniform_by_size"]] == co["sizes_gb"]
    assert co["co_optimised"]["t_iter_s"] == pytest.approx(best.t_iter_s) and co["frontier"]
    assert [a for a in plan.alternatives if a["chosen"]] == [a for a in plan.alternatives
                                                             if a.get("compared") == "co-optimiser"]


@pytest.mark.parametrize("limit", ["budget", "deadline"])
def test_budget_and_deadline_are_respected_exactly(limit):
    job = TrainJob(strategy="auto", workers=4, max_workers=8, batch_size=8, microbatches=2, epochs=2)
    target = ComputeTarget(**LAMBDA)
    problem, points = brute_points(job, target)
    n = iterations(job)
    fastest = min(points, key=lambda p: (p.t_iter_s, p.c_iter))
    cheapest = min(points, key=lambda p: (p.c_iter, p.t_iter_s))
    assert fastest.c_iter > cheapest.c_iter and fastest.t_iter_s < cheapest.t_iter_s   # a real trade-off
    if limit == "budget":
        cap = (fastest.c_iter + cheapest.c_iter) / 2
        job = job.model_copy(update={"budget_usd": cap * n})
        ok = [p for p in points if p.c_iter <= cap]
        best = min(ok, key=lambda p: (p.t_iter_s, p.c_iter))
    else:
        cap = (fastest.t_iter_s + cheapest.t_iter_s) / 2
        job = job.model_copy(update={"deadline_s": cap * n})
        ok = [p for p in points if p.t_iter_s <= cap]
        best = min(ok, key=lambda p: (p.c_iter, p.t_iter_s))
    plan = make(job, target)
    assert_same_choice(plan, problem, best)
    chosen = plan.co_optimizer["co_optimised"]
    assert (chosen["c_iter_usd"] <= cap * (1 + 1e-9)) if limit == "budget" else (chosen["t_iter_s"] <= cap * (1 + 1e-9))
    assert limit in plan.co_optimizer["rule"]


def test_a_stage_that_does_not_fit_the_small_size_alone_gets_a_larger_one():
    """Same speed at every container tier: the cheapest fit, the big layer's stage at 4 GB and
    the rest at 1 GB; the uniform plan at the target's 1 GB does not fit at all."""
    layers = [dict(LAYERS[0], param_bytes=400 * MB)] + LAYERS[1:]
    job = TrainJob(strategy="pipeline", workers=1, batch_size=8, microbatches=2, stages=2)
    target = ComputeTarget(kind="aci", offer="aci-cpu", worker_memory_gb=1.0, worker_memory_options_gb=[1.0, 4.0])
    with pytest.raises(ZooidValueError, match="^memory: "):
        make(job, target.model_copy(update={"worker_memory_options_gb": []}), layers)
    plan = make(job, target, layers)
    assert plan.co_optimizer["used"] and "uniform" not in plan.co_optimizer
    assert plan.stage_memory_gb == (4.0, 1.0)
    problem, points = brute_points(job, target, layers)
    assert_same_choice(plan, problem, brute_force_optimum(points))


def test_one_size_plans_as_today_and_says_why():
    from coordinator.plan.planning import strategy_inputs, uniform_plan

    job = TrainJob(strategy="auto", workers=4, batch_size=8, microbatches=2)
    target = ComputeTarget(kind="aci", offer="aci-cpu", worker_memory_gb=2.0)
    plan = make(job, target)
    assert plan.co_optimizer == {"used": False, "reason": "the target offers one worker size (2 GB)"}
    ctx = context(job, target)
    assert dataclasses.replace(plan, co_optimizer={}) == uniform_plan(ctx, profile(), strategy_inputs(ctx, profile(), 4))
    assert plan.stage_memory_gb == ()
    same = make(job, target.model_copy(update={"worker_memory_options_gb": [2.0, 2.0]}))
    assert same.co_optimizer["used"] is False and same.stage_memory_gb == ()


def test_bad_sizes_are_refused_in_one_line_naming_the_parameter():
    from pydantic import ValidationError

    from coordinator.run.validate import check_worker_sizes

    with pytest.raises(ValidationError, match="worker_memory_options_gb"):
        ComputeTarget(worker_memory_options_gb=[2.0, -1.0])
    for bad in ([0.0], [float("nan")], [float("inf"), 2.0]):
        target = ComputeTarget.model_construct(**{**ComputeTarget().model_dump(), "worker_memory_options_gb": bad})
        with pytest.raises(ZooidValueError) as err:
            check_worker_sizes(target, get_offer("aci-cpu"))
        assert str(err.value).startswith("worker_memory_options_gb: ") and "\n" not in str(err.value)
    with pytest.raises(ZooidValueError, match="^worker_memory_options_gb: offer ec2-c5.xlarge is billed per whole"):
        check_worker_sizes(ComputeTarget(worker_memory_options_gb=[4, 8]), get_offer("ec2-c5.xlarge"))
    assert check_worker_sizes(ComputeTarget(worker_memory_options_gb=[4, 1, 4]), get_offer("aci-cpu")) == (1.0, 4.0)


def test_plan_round_trips_with_per_stage_sizes_and_reads_old_dicts():
    plan = Plan(strategy="pipeline", data_parallel=1, stages=2, cuts=(1,), microbatches=4,
                worker_memory_gb=4.0, stage_memory_gb=(4.0, 1.0),
                co_optimizer={"used": True, "sizes_gb": [1.0, 4.0]})
    assert Plan.from_dict(plan.to_dict()) == plan
    old = {k: v for k, v in plan.to_dict().items() if k not in ("stage_memory_gb", "co_optimizer")}
    assert Plan.from_dict(old) == dataclasses.replace(plan, stage_memory_gb=(), co_optimizer={})


def test_the_exact_frontier_with_stage_limits_matches_brute_force():
    from planners.co_optimize import parse_problem
    from planners.co_optimize_flow import frontier
    from tests.test_planners_co_optimize import all_plans, random_doc

    for seed in range(25):
        rng = random.Random(seed)
        problem = parse_problem(random_doc(rng, rng.randint(2, 6), rng.randint(1, 3), 3))
        limits = lambda d: (2, max(1, 4 // d))
        plans, t, c = all_plans(problem)
        ok = [(t[i], c[i]) for i, s in enumerate(plans) if 2 <= len(s.options) <= max(1, 4 // s.d)]
        found = frontier(problem, limits)
        assert bool(found) == bool(ok)
        for point in found:
            assert 2 <= len(point.solution.options) <= max(1, 4 // point.solution.d)
        for bt, bc in ok:   # every brute-force solution is matched or beaten by a frontier point
            assert any(p.t_iter_s <= bt * (1 + 1e-9) + 1e-12 and p.c_iter <= bc * (1 + 1e-9) + 1e-12 for p in found)


def test_the_dry_run_report_lists_what_the_co_optimiser_compared():
    from coordinator.report.report import co_optimizer_lines
    from flows.dry_run import plan_report

    job = TrainJob(strategy="auto", workers=4, batch_size=8, microbatches=2)
    several = make(job, ComputeTarget(**LAMBDA)).to_dict()
    markdown = plan_report(job, several)
    assert "Co-optimiser (exact, worker sizes 1/2/4/8 GB" in markdown and "| co-optimised |" in markdown
    assert all(f"| best uniform at {g:g} GB |" in markdown for g in (1, 2, 4, 8))
    assert "The uniform plan it would otherwise run" in markdown and "GB per stage)" in markdown
    one = make(job, ComputeTarget(kind="aci", offer="aci-cpu")).to_dict()
    assert "Co-optimiser not used: the target offers one worker size (2 GB)." in plan_report(job, one)
    assert co_optimizer_lines({}) == []


def test_each_stage_is_launched_predicted_and_billed_at_its_own_size():
    """The co-optimised 4 GB + 1 GB pipeline, as hybrid D = 2: a worker asks the cloud for its
    stage's size, the ledger bills it at that size, and the prediction prices the same mix."""
    from coordinator.bill.cost import worker_records
    from coordinator.run.context import RunContext
    from coordinator.workers.launchers import launch_identity, make_launcher

    layers = [dict(LAYERS[0], param_bytes=400 * MB)] + LAYERS[1:]
    job = TrainJob(strategy="hybrid", workers=2, batch_size=8, microbatches=2, stages=2)
    target = ComputeTarget(kind="aci", offer="aci-cpu", worker_memory_gb=1.0, worker_memory_options_gb=[1.0, 4.0])
    plan = make(job, target, layers)
    assert plan.co_optimizer["used"] and plan.stage_memory_gb == (4.0, 1.0) and plan.data_parallel == 2
    assert [plan.memory_gb_of(rank) for rank in range(plan.workers)] == [4.0, 1.0, 4.0, 1.0]

    offer = get_offer(target.offer)
    ctx = RunContext(run_id="zsizes", job=job, resolved=SimpleNamespace(target=target, offer=offer,
                                                                        shared_parameters=()))
    launcher = make_launcher(ctx, plan)
    assert [launcher.variables_of(rank)["memory"] for rank in range(plan.workers)] == [4.0, 1.0, 4.0, 1.0]
    assert launch_identity(launcher, 0) == launch_identity(launcher, 2) != launch_identity(launcher, 1)

    price = {gb: offer.price_per_s(target.worker_vcpu, gb, 0) for gb in (1.0, 4.0)}
    outcomes = [dict(rank=r, attempt=0, status="completed", started_at=10.0, stopped_at=20.0) for r in range(4)]
    rows = worker_records("zsizes", 0, outcomes, offer, ctx.price_of(plan))
    assert [r.unit_price_per_s for r in rows] == [price[4.0], price[1.0], price[4.0], price[1.0]]
    assert plan.predicted_cost_per_epoch_usd == pytest.approx(plan.predicted_epoch_s * 2 * (price[4.0] + price[1.0]))

    uniform = dataclasses.replace(plan, stage_memory_gb=())  # no per-stage sizes: the target's size, as before
    assert {r.unit_price_per_s for r in worker_records("zsizes", 0, outcomes, offer, ctx.price_of(uniform))} \
        == {ctx.price_per_worker_s}

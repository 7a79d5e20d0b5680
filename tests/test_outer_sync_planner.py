"""The planner knows the sync dtype and the outer state: bytes per round, the strategy choice,
the predicted epoch and bill, and the calibration refit (pure planners, no torch)."""
from __future__ import annotations

import pytest

from core.epoch_summary import EpochSummary
from core.outer_sync import INT8_BLOCK, wire_bytes
from planners.calibration import calibrated, fit
from planners.pipeline_time import TransferCosts
from planners.strategy import choose, local_sgd, pipeline_prediction, with_sync
from planners.sync_time import pipelined_scatter_reduce, scatter_reduce
from tests.test_strategy import _inputs


def test_wire_bytes_per_dtype():
    assert wire_bytes(16e6, "float32") == 16e6
    assert wire_bytes(16e6, "bfloat16") == 8e6
    values = 4e6
    assert wire_bytes(16e6, "int8") == values + 4 * -(-values // INT8_BLOCK)
    assert 0.25 < wire_bytes(16e6, "int8") / 16e6 < 0.251  # a float32 scale per 1024 values
    with pytest.raises(ValueError, match="sync_dtype"):
        wire_bytes(1.0, "int4")


@pytest.mark.parametrize("sync_dtype,outer", [("float32", "average"), ("bfloat16", "average"),
                                               ("int8", "average"), ("int8", "nesterov"), ("float32", "nesterov")])
def test_a_local_sgd_round_moves_the_wire_bytes_and_writes_the_outer_state(sync_dtype, outer):
    costs = TransferCosts(5e-3, 2e8, 1e-3, 3e8, 0.0)
    x = _inputs(sync_bandwidth=4e8, sync_latency=2e-3, transfer=costs, sync_dtype=sync_dtype, outer_optimizer=outer)
    plan = choose(x, "local_sgd")
    steps = 4096 // (4 * 32)
    sync = scatter_reduce(wire_bytes(16e6, sync_dtype), 4, 4e8, 2e-3) + costs.put_s(16e6)  # the sync checkpoint
    if sync_dtype != "float32":
        sync += costs.put_s(16e6)  # every rank's float32 residual, written before it posts its slice
    if outer == "nesterov":
        sync += 16e6 / 2e8  # the momentum buffer in the sync checkpoint
    assert plan.predicted_epoch_s == pytest.approx(steps * (0.12 + sync))
    assert plan.predicted_cost_per_epoch_usd == pytest.approx(plan.predicted_epoch_s * 4 * 1e-5)


def test_a_hybrid_s_gradient_syncs_move_the_wire_bytes():
    x = _inputs(stages=2, sync_bandwidth=4e8, sync_latency=2e-3, sync_dtype="bfloat16")
    plan = choose(x, "hybrid")
    syncs = [i.end - i.start for row in pipeline_prediction(x, plan).simulation.timelines
             for i in row if i.resource == "sync"]
    assert syncs == pytest.approx([pipelined_scatter_reduce(4e6, 4, 4e8, 2e-3)] * 2)  # 8 MB of float32 per stage


def test_compressed_syncs_change_the_strategy_choice_and_lower_the_bill():
    f32 = choose(_inputs(bandwidth=4e8, sync_period=4), "auto")
    int8 = choose(_inputs(bandwidth=4e8, sync_period=4, sync_dtype="int8"), "auto")
    assert (f32.strategy, int8.strategy) == ("pipeline", "local_sgd")
    assert int8.predicted_epoch_s < f32.predicted_epoch_s
    assert int8.predicted_cost_per_epoch_usd < f32.predicted_cost_per_epoch_usd


def test_calibration_refits_the_sync_with_the_bytes_the_dtype_moves():
    """An int8 epoch that ran exactly as its plan predicted refits to no change; read as if
    it had moved float32 bytes, the same measurement would call the store 4x faster."""
    x = _inputs(sync_bandwidth=4e8, sync_latency=1e-6, sync_dtype="int8", checkpoint_s=0.0,
                transfer=TransferCosts(0.0, 1e12, 0.0, 1e12, 0.0))
    plan = local_sgd(x)
    measured = EpochSummary(epoch=0, workers=plan.workers, train_loss=1.0, seconds=plan.predicted_epoch_s,
                            measured_iteration_s=plan.predicted_iteration_s,
                            compute_s=plan.predicted_compute_s * plan.steps_per_epoch)
    right = fit(plan, measured, inputs=x)
    assert right.sync_scale == pytest.approx(1.0, rel=1e-6)
    as_f32 = _inputs(sync_bandwidth=4e8, sync_latency=1e-6, checkpoint_s=0.0,
                     transfer=TransferCosts(0.0, 1e12, 0.0, 1e12, 0.0))
    wrong = fit(local_sgd(as_f32), measured, inputs=as_f32)
    assert wrong.sync_scale < 0.3
    # the refitted inputs keep the dtype: the next plan predicts the same epoch
    assert local_sgd(calibrated(x, right)).predicted_epoch_s == pytest.approx(plan.predicted_epoch_s, rel=1e-6)


def test_the_plan_names_its_sync_and_the_bytes_one_sync_reduces():
    x = _inputs(sync_dtype="int8", outer_optimizer="nesterov", optimizer_copies=1)
    plan = with_sync(x, choose(x, "local_sgd"))
    assert (plan.outer_optimizer, plan.sync_dtype, plan.sync_bytes) == ("nesterov", "int8", wire_bytes(32e6, "int8"))
    y = _inputs(stages=2, sync_dtype="bfloat16", outer_optimizer="nesterov")
    hyb = with_sync(y, choose(y, "hybrid"))
    assert (hyb.outer_optimizer, hyb.sync_bytes) == ("average", 8e6)  # a hybrid averages gradients


@pytest.mark.parametrize("period, outer, dtype, averaged", [
    (1, "average", "float32", 16e6),  # every step: the gradients alone, no optimizer state
    (2, "average", "float32", 32e6),  # k > 1: parameters and momentum
    (1, "nesterov", "float32", 32e6),  # an outer step averages parameters, even every step
    (1, "average", "bfloat16", 16e6),  # a lossy wire too: parameters and momentum, each half the bytes
])
def test_a_momentum_job_s_sync_moves_the_gradients_alone_only_when_it_averages_them(period, outer, dtype, averaged):
    x = _inputs(optimizer_copies=1, sync_period=period, outer_optimizer=outer, sync_dtype=dtype)
    assert with_sync(x, choose(x, "local_sgd")).sync_bytes == averaged


def _summary(plan: dict, bytes_synced: int):
    from coordinator.run.job import EpochSummary, RunSummary

    epoch = EpochSummary(epoch=0, workers=4, train_loss=1.0, seconds=10.0, samples_per_s=1.0, cost_usd=0.01,
                         bytes_synced=bytes_synced)
    return RunSummary(run_id="r", status="completed", plan=plan, epochs=[epoch, epoch])


def test_the_report_and_the_dry_run_say_the_outer_optimizer_the_dtype_and_the_bytes_per_sync():
    from coordinator.report.report import plan_details, plan_in_words
    from coordinator.run.job import TrainJob
    from flows.dry_run import plan_report

    x = _inputs(sync_dtype="int8", outer_optimizer="nesterov", sync_period=8)
    plan = with_run_fields(with_sync(x, choose(x, "local_sgd")))
    p = plan.to_dict()
    words = plan_in_words(p)
    assert "outer optimizer nesterov, syncs in int8 (4.02 MB of state per sync)" in words
    # 32 steps per epoch at k = 8: 4 syncs x 4 replicas x 2 epochs = 32 syncs moving 6.4 MB
    rows = dict(plan_details(_summary(p, 3_200_000)))
    assert rows["outer sync"].endswith("; 0.2 MB moved per replica per sync (measured)")
    job = TrainJob(outer_optimizer="nesterov", sync_dtype="int8")
    assert "outer optimizer nesterov, syncs in int8" in plan_report(job, p)
    default = choose(_inputs(), "local_sgd").to_dict()
    assert "outer" not in plan_in_words(default) and "outer sync" not in dict(plan_details(_summary(default, 1)))


def with_run_fields(plan):
    """The fields the dry run's text reads beside the planner's (`with_run` adds them)."""
    from dataclasses import replace

    return replace(plan, predicted_run_s=1.0, predicted_run_cost_usd=0.01, predicted_first_epoch_s=1.0)


@pytest.mark.parametrize("sync_dtype", ["float32", "bfloat16", "int8"])
def test_the_co_optimiser_prices_a_hybrid_s_syncs_in_the_job_s_dtype(monkeypatch, sync_dtype):
    """A job offered several worker sizes: the problem the co-optimiser solves carries the
    bytes a sync moves per float32 byte (wire_bytes(P) / P of the model's P), the plan's
    record says so, and the choice is the brute-force optimum of that problem."""
    from dataclasses import replace

    import coordinator.plan.co_plan
    import coordinator.plan.planning
    from blocks.compute import ComputeTarget
    from coordinator.run.job import TrainJob
    from planners.co_optimize import evaluate
    from planners.co_optimize_flow import Point
    from tests.test_co_optimizer_in_plan import (LAMBDA, LAYERS, assert_same_choice, brute_force_optimum,
                                                 brute_points, make)

    monkeypatch.setattr(coordinator.plan.planning, "with_run", lambda ctx, chosen, calibration, epochs_left, **kw: chosen)
    solved = []
    frontier = coordinator.plan.co_plan.frontier
    monkeypatch.setattr(coordinator.plan.co_plan, "frontier", lambda problem, stages=None: solved.append(problem)
                        or frontier(problem, stages))
    job = TrainJob(strategy="hybrid", workers=2, max_workers=8, batch_size=8, microbatches=2, epochs=2,
                   sync_dtype=sync_dtype)
    target = ComputeTarget(**LAMBDA)
    plan = make(job, target)
    P = sum(layer["param_bytes"] for layer in LAYERS)
    factor = wire_bytes(P, sync_dtype) / P
    assert {p.sync_bytes_factor for p in solved} == {factor}
    co = plan.co_optimizer
    assert co["used"] and co["sync_dtype"] == sync_dtype and co["sync_bytes_factor"] == factor
    problem, points = brute_points(job, target)     # float32's problem, written out by that test
    problem = replace(problem, sync_bytes_factor=factor)
    points = [Point(*evaluate(problem, p.solution.cuts, p.solution.d, p.solution.options)[:2], p.solution)
              for p in points]
    best = brute_force_optimum(points)
    assert_same_choice(plan, problem, best)
    assert co["co_optimised"]["t_iter_s"] == pytest.approx(best.t_iter_s, rel=1e-9)
    if sync_dtype != "float32":   # the same choice priced with float32 syncs takes longer
        f32 = replace(problem, sync_bytes_factor=1.0)
        s = best.solution
        assert evaluate(f32, s.cuts, s.d, s.options)[0] > best.t_iter_s

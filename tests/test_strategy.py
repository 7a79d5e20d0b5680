"""Strategy choice from measured numbers: same worker budget, same global batch."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planners.strategy import StrategyInputs, candidates, choose


def _inputs(**kw) -> StrategyInputs:
    base = dict(layers=tuple({"forward_s": 0.01, "backward_s": 0.02, "output_bytes": 4096.0,
                              "param_bytes": 4e6} for _ in range(4)),
                profile_batch=32, step_s=0.12, param_bytes=16e6, optimizer_copies=0, n_train=4096,
                batch_size=32, workers=4, stages=None, microbatches=4, sync_period=1,
                bandwidth=1e9, latency=1e-3, offer="aci-cpu", price_per_worker_s=1e-5)
    base.update(kw)
    return StrategyInputs(**base)


def test_auto_keeps_the_worker_budget_and_the_global_batch():
    x = _inputs()
    for p in candidates(x, "auto"):
        assert p.workers <= x.workers
        assert p.data_parallel * p.batch_size == x.workers * x.batch_size
        assert p.stages == 1 or p.batch_size == p.microbatches * (x.batch_size // 4)


def test_cheap_sync_picks_local_sgd_and_slow_links_pick_a_pipeline():
    fast = choose(_inputs(bandwidth=1e12, latency=1e-6), "auto")
    assert fast.strategy == "local_sgd" and fast.data_parallel == 4
    slow = choose(_inputs(bandwidth=2e6), "auto")  # 16 MB every step through a 2 MB/s store
    assert slow.strategy in ("pipeline", "hybrid") and slow.stages >= 2
    chosen = [a for a in slow.alternatives if a["chosen"]]
    assert len(chosen) == 1 and chosen[0]["strategy"] == slow.strategy
    assert min(a["predicted_iteration_s"] / (a["data_parallel"] * 1) for a in slow.alternatives) > 0


def test_forced_strategies_and_infeasible_ones():
    assert choose(_inputs(), "local_sgd").strategy == "local_sgd"
    pipe = choose(_inputs(stages=2), "pipeline")
    assert (pipe.strategy, pipe.data_parallel, pipe.stages, pipe.microbatches) == ("pipeline", 1, 2, 4)
    hyb = choose(_inputs(stages=2), "hybrid")
    assert (hyb.data_parallel, hyb.stages, hyb.batch_size) == (4, 2, 32)
    with pytest.raises(ValueError, match="strategy"):
        choose(_inputs(layers=()), "pipeline")


def test_parameter_free_layers_never_make_a_stage_of_their_own():
    from planners.strategy import merge_parameter_free

    layer = lambda p: {"forward_s": 1.0, "backward_s": 2.0, "output_bytes": 10.0 + p, "param_bytes": p}
    merged, last = merge_parameter_free([layer(0), layer(5), layer(0), layer(3), layer(0)])
    assert last == [1, 4]
    assert [m["param_bytes"] for m in merged] == [5, 3]
    assert [m["forward_s"] for m in merged] == [2.0, 3.0]
    assert merged[0]["output_bytes"] == 15.0 and merged[1]["output_bytes"] == 10.0
    x = _inputs(layers=(layer(0), layer(4e6), layer(0), layer(4e6)), bandwidth=2e6)
    for p in candidates(x, "pipeline"):
        assert all(c in (1, 3) for c in p.cuts)


def test_pipeline_plans_report_the_executor_model_and_keep_the_contract_figure():
    from planners.pipeline_time import TransferCosts
    from planners.strategy import pipeline_prediction

    x = _inputs(stages=2, bandwidth=2e6, transfer=TransferCosts(2e-3, 5e6, 1e-3, 8e6, 4e-3),
                optimizer_step_s=0.04)
    plan = choose(x, "pipeline")
    t = pipeline_prediction(x, plan)
    assert plan.predicted_iteration_s == t.period_s
    assert plan.predicted_epoch_s == plan.steps_per_epoch * t.period_s
    row = next(a for a in plan.alternatives if a["chosen"])
    assert row["planner_objective_s"] == plan.planner_objective_s > 0
    assert row["planner_objective_s"] != row["predicted_iteration_s"]
    # the stage's share of the optimizer step ends its cycle: half the parameters each
    assert t.stage_period_s[0] == pytest.approx(
        max(i.end for i in t.simulation.timelines[0]) + 0.02)


def test_hybrid_sync_uses_the_fitted_collective_link():
    from planners.strategy import pipeline_prediction
    from planners.sync_time import pipelined_scatter_reduce

    x = _inputs(stages=2, sync_bandwidth=4e8, sync_latency=2e-3)
    plan = choose(x, "hybrid")
    syncs = [i.end - i.start for row in pipeline_prediction(x, plan).simulation.timelines
             for i in row if i.resource == "sync"]
    # each stage holds two of the four 4 MB layers, synced among the 4 replicas
    assert syncs == pytest.approx([pipelined_scatter_reduce(8e6, 4, 4e8, 2e-3)] * 2)


def test_local_sgd_uses_the_collective_link_and_the_measured_checkpoint_put():
    from planners.pipeline_time import TransferCosts
    from planners.sync_time import scatter_reduce

    costs = TransferCosts(5e-3, 2e8, 1e-3, 3e8, 0.0)
    plan = choose(_inputs(sync_bandwidth=4e8, sync_latency=2e-3, transfer=costs), "local_sgd")
    steps = 4096 // (4 * 32)
    sync = scatter_reduce(16e6, 4, 4e8, 2e-3) + costs.put_s(16e6)
    assert plan.predicted_epoch_s == pytest.approx(steps * (0.12 + sync))


def test_layer_fixed_parts_scale_affinely_and_survive_merging():
    from planners.strategy import _microbatch_layers, merge_parameter_free

    layers = ({"forward_s": 0.4, "backward_s": 0.8, "output_bytes": 64.0, "param_bytes": 0.0,
               "forward_fixed_s": 0.2, "backward_fixed_s": 0.4},
              {"forward_s": 0.2, "backward_s": 0.4, "output_bytes": 32.0, "param_bytes": 8.0})
    micro = _microbatch_layers(_inputs(layers=layers), 8)  # a quarter of the 32-row profile
    assert [m["forward_s"] for m in micro] == pytest.approx([0.25, 0.05])
    merged, last = merge_parameter_free(micro)
    assert last == [1]
    assert merged[0]["forward_fixed_s"] == 0.2 and merged[0]["backward_fixed_s"] == 0.4
    assert merged[0]["forward_s"] == pytest.approx(0.3) and merged[0]["output_bytes"] == 8.0


def test_measured_checkpoint_write_replaces_the_put_model():
    from planners.sync_time import scatter_reduce

    plan = choose(_inputs(sync_bandwidth=4e8, sync_latency=2e-3, checkpoint_s=0.05), "local_sgd")
    steps = 4096 // (4 * 32)
    assert plan.predicted_epoch_s == pytest.approx(steps * (0.12 + scatter_reduce(16e6, 4, 4e8, 2e-3) + 0.05))


def test_contention_slows_a_pipeline_stage_compute_by_its_transfer_duty_not_local_sgd():
    from planners.pipeline_time import TransferCosts, stage_times
    from planners.strategy import local_sgd, pipeline_prediction, stage_contention

    # per micro-batch (8 rows) a stage computes 2 x (F 2.5 ms + B 5 ms) = 15 ms; a put or get
    # of its 1024-byte activation costs `t`
    x = _inputs(stages=2, optimizer_step_s=0.0)
    plan = choose(x, "pipeline")
    stages = stage_times(x.layers, plan.cuts, 8, 32)
    for t, duty in ((0.0, 0.0), (0.0015, 0.2), (0.00375, 0.5), (0.02, 1.0)):
        costs = TransferCosts(t, 1e30, t, 1e30, 0.0)
        # stage 0 puts its activation and gets its gradient, stage 1 the reverse: 2 t of 15 ms
        assert stage_contention(1.5, stages, costs) == pytest.approx([1 + 0.5 * duty] * 2)
    free = TransferCosts(0.0, 1e30, 0.0, 1e30, 0.0)
    assert pipeline_prediction(replace(x, transfer=free, contention=1.5), plan).period_s == \
        pytest.approx(pipeline_prediction(replace(x, transfer=free), plan).period_s)  # nothing moves
    busy = TransferCosts(0.02, 1e30, 0.02, 1e30, 0.0)  # transfers outlast compute: the whole beta
    compute_only = replace(x, transfer=busy, sync_bandwidth=1e30, sync_latency=0.0)
    slowed = pipeline_prediction(replace(compute_only, contention=1.5), plan).simulation
    plain = pipeline_prediction(compute_only, plan).simulation
    for row_slow, row in zip(slowed.timelines, plain.timelines):
        for i_slow, i in zip(row_slow, row):
            if i.resource == "compute" and i.action.kind.value in ("F", "B"):
                assert i_slow.end - i_slow.start == pytest.approx(1.5 * (i.end - i.start))
    assert local_sgd(replace(x, contention=1.5)).predicted_iteration_s == local_sgd(x).predicted_iteration_s


def test_workers_sharing_one_machine_time_share_its_cores():
    from planners.pipeline_time import TransferCosts
    from planners.strategy import local_sgd, pipeline_prediction

    free = TransferCosts(0.0, 1e30, 0.0, 1e30, 0.0)
    x = _inputs(stages=2, transfer=free)
    shared = replace(x, host_cores=2)
    assert [shared.compute_slowdown(n) for n in (1, 2, 3, 4)] == pytest.approx([1.0, 1.0, 1.5, 2.0])
    assert x.compute_slowdown(4) == 1.0  # a machine each: nothing shared
    plan = choose(x, "pipeline")
    assert plan.workers == 2
    # two processes on two cores: each has its core (the profile was taken at its thread count)
    assert pipeline_prediction(shared, plan).period_s == pytest.approx(pipeline_prediction(x, plan).period_s)
    for workers, factor in ((1, 1.0), (2, 1.0), (4, 2.0)):
        gap = local_sgd(shared, workers).predicted_iteration_s - local_sgd(x, workers).predicted_iteration_s
        assert gap == pytest.approx((factor - 1) * x.step_s)


def test_the_plan_step_counts_this_machines_cores_only_where_workers_share_it():
    from types import SimpleNamespace

    from coordinator.plan.planning import strategy_inputs
    from profiling.timing import cpu_count

    job = SimpleNamespace(optimizer="sgd", batch_size=32, stages=None, microbatches=4, sync_period=1,
                          sync_dtype="float32", outer_optimizer="average", collective="store")
    layer = dict(forward_s=0.01, backward_s=0.02, output_bytes=4096, param_bytes=1024)
    transfer = dict(put_latency_s=0.001, put_bandwidth=1e9, get_latency_s=0.0005, get_bandwidth=2e9,
                    handoff_s=0.0013)
    profile = {"layers": [layer, layer], "batch_size": 32, "step_s": 0.06, "param_bytes": 2048,
               "store_bandwidth_bytes_per_s": 1e9, "store_latency_s": 0.001, "store_transfer": transfer}
    cores = {}
    for kind in ("inline", "process", "ecs", "aci", "k8s"):
        ctx = SimpleNamespace(job=job, price_per_worker_s=0.0, resolved=SimpleNamespace(
            target=SimpleNamespace(kind=kind, worker_vcpu=1.0, worker_memory_gb=2.0, worker_gpu=0), n_train=512,
            offer=SimpleNamespace(name="local")))
        x = strategy_inputs(ctx, profile, 4)
        cores[kind] = x.host_cores
        assert x.transfer_costs.handoff_s == 0.0013  # the worker's own probe
    assert cores == {"inline": cpu_count(), "process": cpu_count(), "ecs": None, "aci": None, "k8s": None}


def test_schedule_choice_prefers_the_fastest_and_within_one_percent_the_one_holding_less():
    from dataclasses import replace

    from core.plan import Plan
    from planners.strategy import choose_schedule

    base = Plan(strategy="pipeline", data_parallel=1, stages=4, cuts=(1, 2, 3), microbatches=8)
    one_f_one_b = replace(base, pipeline_schedule="1f1b", predicted_iteration_s=1.005)
    gpipe = replace(base, pipeline_schedule="gpipe", predicted_iteration_s=1.0)
    assert choose_schedule([one_f_one_b, gpipe]) is one_f_one_b  # within 1 %: less memory wins
    assert choose_schedule([replace(one_f_one_b, predicted_iteration_s=1.05), gpipe]) is gpipe
    assert choose_schedule([one_f_one_b]) is one_f_one_b


def test_1f1b_fits_a_worker_gpipe_does_not():
    """Stage memory by the micro-batches each schedule holds: GPipe all M on every stage,
    1F1B min(k - s, M) on stage s, so a size too small for GPipe's stage 0 fits 1F1B's."""
    from core.schedule_costs import ideal_peak_in_flight
    from core.stage_memory import stage_memory

    acts, params = [100.0] * 4, [10.0] * 4  # per layer: activation bytes per micro-batch, parameter bytes
    k, m = 4, 8
    for schedule, expect_fit in (("gpipe", False), ("1f1b", True)):
        held = [ideal_peak_in_flight(schedule, k, m, worker=s) for s in range(k)]
        report = stage_memory(activation_bytes=acts, param_bytes=params, cuts=[1, 2, 3], microbatches=m,
                              available_bytes=600.0, in_flight=held)
        assert [r.activation_bytes for r in report] == [100.0 * h for h in held]
        assert all(r.fits for r in report) is expect_fit
    assert [ideal_peak_in_flight("1f1b", k, m, worker=s) for s in range(k)] == [4, 3, 2, 1]


def test_pick_schedule_keeps_the_one_that_fits_and_lists_both(monkeypatch):
    from dataclasses import replace
    from types import SimpleNamespace

    import coordinator.plan.planning
    from coordinator.run.job import TrainJob
    from core.errors import ZooidValueError
    from core.plan import Plan

    times = {"gpipe": 1.0, "1f1b": 1.2}
    monkeypatch.setattr(coordinator.plan.planning, "with_schedule",
                        lambda x, plan, name: replace(plan, pipeline_schedule=name, predicted_iteration_s=times[name]))

    def check(ctx, profile, plan):
        if plan.pipeline_schedule == "gpipe":
            raise ZooidValueError("memory", "stage 0 needs 9 GB of 2 GB")

    monkeypatch.setattr(coordinator.plan.planning, "check_memory", check)
    plan = Plan(strategy="pipeline", data_parallel=1, stages=2, cuts=(1,), microbatches=4)
    ctx = SimpleNamespace(job=TrainJob(pipeline_schedule="auto"))
    chosen = coordinator.plan.planning.pick_schedule(ctx, {}, None, plan)
    assert chosen.pipeline_schedule == "1f1b"
    assert [(a["pipeline_schedule"], a["fits"], a["chosen"]) for a in chosen.alternatives] == [
        ("1f1b", True, True), ("gpipe", False, False)]
    ctx = SimpleNamespace(job=TrainJob(pipeline_schedule="gpipe"))
    with pytest.raises(ZooidValueError, match="^memory: gpipe: stage 0 needs 9 GB"):
        coordinator.plan.planning.pick_schedule(ctx, {}, None, plan)

"""Issue 15: the profile is taken on the target, cached by what makes it hold, and the plan
predicts the run's time and bill and is calibrated by its epochs."""
from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from coordinator.run.job import TrainJob
from core.epoch_summary import EpochSummary
from core.errors import ZooidValueError
from core.plan import Plan
from planners.calibration import Calibration, calibrated, epoch_overhead, fit
from planners.run_prediction import RunTerms, predict_run


def _ctx(job: TrainJob):
    from coordinator.run.context import RunContext
    from coordinator.run.validate import validate_job

    return RunContext(run_id="zprof" + str(abs(hash(job.model)) % 10**6), job=job, resolved=validate_job(job))


# --- pure: calibration and run prediction ---------------------------------------------------


def _plan(**kw) -> Plan:
    base = dict(strategy="local_sgd", data_parallel=2, steps_per_epoch=10, batch_size=16, price_per_worker_s=1e-5,
                predicted_iteration_s=0.02, predicted_compute_s=0.015, predicted_compute_epoch_s=0.2)
    return Plan(**{**base, **kw})


def _measured(**fields) -> EpochSummary:
    """An epoch's row with the fields calibration reads."""
    return EpochSummary(epoch=0, workers=2, train_loss=1.0, **fields)


def test_calibration_refits_compute_sync_and_overhead_from_an_epoch():
    plan = _plan()
    # measured: compute 0.03 s a step (2x), the rest 0.01 s (2x the predicted 0.005), 0.5 s beyond the steps
    measured = EpochSummary(epoch=0, workers=2, train_loss=1.0, seconds=10 * 0.04 + 0.5, measured_iteration_s=0.04,
                            compute_s=0.3, startup={"mode": "warm", "exposed_s": 0.0})
    c = fit(plan, measured)
    assert (c.step_scale, c.layer_scale, c.sync_scale, c.transfer_scale) == pytest.approx((2.0, 1.0, 2.0, 1.0))
    assert c.overhead_s == pytest.approx(0.5) and c.epochs == 1
    # a later epoch refines the ratios relative to the raw profile, not to the last plan
    again = fit(_plan(predicted_compute_s=0.03, predicted_iteration_s=0.04), measured, c)
    assert (again.step_scale, again.sync_scale) == pytest.approx((2.0, 2.0))
    # the first epoch of a worker set built models and read data: no steady overhead from it
    assert fit(plan, measured, first=True).overhead_s is None
    # start-up the epoch exposed is not overhead
    assert epoch_overhead(plan, replace(measured, startup={"exposed_s": 0.2})) == pytest.approx(0.3)


def test_a_pipeline_epoch_calibrates_transfers_and_leaves_the_sync_alone():
    c = fit(_plan(strategy="pipeline", data_parallel=1, stages=2),
            _measured(seconds=1.0, measured_iteration_s=0.06, compute_s=0.15))
    assert (c.layer_scale, c.step_scale, c.transfer_scale, c.sync_scale) == pytest.approx((1.0, 1.0, 9.0, 1.0))


def test_calibrated_inputs_predict_what_was_measured():

    from planners.strategy import local_sgd
    from tests.test_strategy import _inputs

    x = _inputs(sync_period=2)
    before = local_sgd(x, 2)
    steps = before.steps_per_epoch
    measured = _measured(seconds=steps * 3 * before.predicted_iteration_s,
                         measured_iteration_s=3 * before.predicted_iteration_s,
                         compute_s=steps * 3 * before.predicted_compute_s)
    after = local_sgd(calibrated(x, fit(before, measured)), 2)
    assert after.predicted_iteration_s == pytest.approx(3 * before.predicted_iteration_s, rel=1e-6)
    assert calibrated(x, Calibration()) is x
    assert replace(x).step_s == x.step_s


def test_run_prediction_adds_startup_idle_gaps_and_the_coordinator():
    plan = _plan(data_parallel=2, predicted_compute_epoch_s=2.0, price_per_worker_s=1.0)
    terms = RunTerms(startup_s=5.0, epoch_overhead_s=0.5, gap_s=0.3, provision_s=1.0, teardown_s=2.0,
                     stop_s=1.0, warmup_s=0.7)
    warm = predict_run(plan, terms, epochs=3, warm=True, workers_launched_s=None, billed_usd=0.25)
    assert warm.epoch_s == pytest.approx(2.5)
    assert warm.first_epoch_s == pytest.approx(2.5 + (5.0 - 1.0) + 0.7)  # waits for what start-up is left
    training = warm.first_epoch_s + 2 * 2.5 + 2 * 0.3
    assert warm.run_s == pytest.approx(1.0 + training + 2.0)
    assert warm.worker_s == pytest.approx(2 * (1.0 + training + 1.0))
    assert warm.cost_usd == pytest.approx(0.25 + warm.worker_s + warm.run_s)
    # workers launched 10 s ago (before the profile) are ready: nothing exposed
    assert predict_run(plan, terms, epochs=3, warm=True, workers_launched_s=10.0).first_epoch_s == \
        pytest.approx(2.5 + 0.7)
    cold = predict_run(plan, terms, epochs=3, warm=False, workers_launched_s=None)
    assert cold.epoch_s == pytest.approx(2.5 + 5.0 + 0.7)  # every epoch starts its workers again
    assert cold.worker_s == pytest.approx(2 * 3 * cold.epoch_s)


def test_a_gpu_job_is_never_planned_from_a_cpu_profile():
    from coordinator.plan.target_profile import check_device

    check_device({"device": "cuda", "device_name": "H100"}, worker_gpu=1)
    check_device({"device": "cpu", "device_name": "EPYC"}, worker_gpu=0)
    with pytest.raises(ZooidValueError, match="^worker_gpu: .*cpu"):
        check_device({"device": "cpu", "device_name": "EPYC"}, worker_gpu=1)


def test_model_identity_hashes_the_source_of_a_model_given_by_import_path(tmp_path, monkeypatch):
    from coordinator.plan.profile_cache import model_identity

    (tmp_path / "idmodel.py").write_text("from torch import nn\ndef net():\n    return nn.Linear(64, 10)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = model_identity("idmodel:net")
    assert first.startswith("idmodel:net@") and model_identity("idmodel:net") == first
    (tmp_path / "idmodel.py").write_text("from torch import nn\ndef net():\n    return nn.Linear(64, 10)  # v2\n")
    assert model_identity("idmodel:net") != first
    assert model_identity("digits_mlp") == "digits_mlp"


# --- on a real worker ------------------------------------------------------------------------


@pytest.mark.usefixtures("prefect_api")
def test_the_profile_is_taken_by_a_worker_and_says_where(tmp_path):
    from coordinator.plan.target_profile import _profile
    from coordinator.workers.launchers import worker_threads
    from coordinator.workers.sweep import tagged_pids
    from coordinator.workers.warm_pool import provisional_plan

    ctx = _ctx(TrainJob(model="digits_mlp", workers=2, store=f"file://{tmp_path}/store", warm=False))
    prof = _profile(ctx)
    assert prof["device"] == "cpu" and prof["torch"] == torch.__version__
    assert prof["threads"] == worker_threads("inline", provisional_plan(ctx))
    assert prof["identity"]["hardware"].endswith(f"/{prof['threads']}t/torch{torch.__version__}/nogpu")
    assert prof["profile_sources"] == {"model": "measured", "store": "measured"}
    assert prof["layers"] and prof["step_s"] > 0 and prof["base_memory_bytes"] > 0
    # measured by a one-off worker, billed, stopped, its keys gone
    statuses = [r.status for r in ctx.state.ledger]
    assert "profile" in statuses and "startup" in statuses
    assert all(r.usd > 0 for r in ctx.state.ledger if r.status == "profile")
    # the store probe's requests reach the bill with the workers' (a successful reply carried none)
    probe = ctx.state.store_ops["file://"]
    assert probe.put > 0 and probe.get > 0 and probe.delete > 0 and probe.bytes_in > 0
    assert tagged_pids(ctx.run_id) == []
    store = ctx.open_durable()
    try:
        assert store.list(f"runs/{ctx.run_id}/warm/") == []
    finally:
        store.close()


@pytest.mark.usefixtures("prefect_api")
def test_on_a_shared_host_every_warm_worker_is_ready_before_the_profile_starts(tmp_path):
    """The flow starts the run's warm workers before the profile; on the coordinator's own
    cores the profile waits until they have all started (their start-up would slow its
    timings), so no rank is left to start after the plan. Then rank 0 profiles the model
    while rank 1 probes the store: the two measurements overlap."""
    from coordinator.plan.target_profile import _profile
    from coordinator.workers.warm_pool import WarmPool, provisional_plan

    ctx = _ctx(TrainJob(model="digits_mlp", workers=2, store=f"file://{tmp_path}/store", warm=True))
    ctx.state.warm = WarmPool(ctx)
    try:
        ctx.state.warm.ensure(provisional_plan(ctx), 0)
        assert _profile(ctx)["profile_sources"] == {"model": "measured", "store": "measured"}
        rows = ctx.state.ledger
        ready = {r.rank: r.stop for r in rows if r.status == "startup"}
        first_profile = min(r.start for r in rows if r.status == "profile")
        assert set(ready) == {0, 1} and max(ready.values()) <= first_profile
        profiles = {r.rank: r for r in rows if r.status == "profile"}
        assert set(profiles) == {0, 1} and len([r for r in rows if r.status == "profile"]) == 2
        assert profiles[0].start < profiles[1].stop and profiles[1].start < profiles[0].stop
    finally:
        ctx.state.warm.stop_all("the test is over")


@pytest.mark.usefixtures("prefect_api")
def test_the_cache_hits_on_a_second_run_and_misses_when_the_models_source_changes(tmp_path, monkeypatch):
    from coordinator.plan.target_profile import _profile

    source = tmp_path / "cachedmodel.py"
    source.write_text("from torch import nn\ndef net():\n    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), "
                      "nn.Linear(32, 10))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(p for p in sys.path if p))
    store = f"file://{tmp_path}/store"
    job = TrainJob(model="cachedmodel:net", workers=2, store=store, warm=False)
    first = _ctx(job)
    assert _profile(first)["profile_sources"] == {"model": "measured", "store": "measured"}
    second = _ctx(job)
    assert _profile(second)["profile_sources"] == {"model": "cache", "store": "cache"}
    assert second.state.ledger == []  # nothing measured: no worker started
    source.write_text(source.read_text() + "# edited\n")
    third = _ctx(job)
    assert _profile(third)["profile_sources"]["model"] == "measured"


@pytest.mark.usefixtures("prefect_api")
def test_a_gpu_target_without_a_gpu_is_refused_by_its_profile(tmp_path, monkeypatch):
    import dataclasses

    from coordinator.plan.target_profile import _profile

    ctx = _ctx(TrainJob(model="digits_mlp", workers=1, store=f"file://{tmp_path}/store", warm=False))
    target = ctx.resolved.target.model_copy(update={"worker_gpu": 1})
    ctx = dataclasses.replace(ctx, resolved=dataclasses.replace(ctx.resolved, target=target))
    if torch.cuda.is_available():
        assert _profile(ctx)["device"] == "cuda"
        return
    with pytest.raises(RuntimeError, match="CUDA was asked for but this worker has no GPU"):
        _profile(ctx)


@pytest.mark.gpu
@pytest.mark.usefixtures("prefect_api")
def test_a_gpu_worker_profiles_on_its_gpu(tmp_path):
    from coordinator.plan.target_profile import _profile

    ctx = _ctx(TrainJob(model="digits_cnn", workers=1, store=f"file://{tmp_path}/store", warm=False))
    prof = _profile(ctx)
    assert prof["device"] == "cuda" and prof["device_name"] == torch.cuda.get_device_name(0)


@pytest.mark.usefixtures("prefect_api")
def test_replanning_after_the_first_epoch_leaves_a_plan_its_measurements_refute(tmp_path):
    """A profile that says activations cross the store for free and averaging the model
    through it is slow makes a pipeline the plan. The first epoch measures the transfers,
    and the re-plan moves to Local-SGD, which averages a few kilobytes once an epoch."""
    from coordinator.plan.profile_cache import ProfileCache, model_key, store_key
    from coordinator.plan.target_profile import _profile
    from flows.train import train

    store = f"file://{tmp_path}/store"
    job = TrainJob(model="digits_mlp", workers=2, epochs=3, batch_size=16, microbatches=8, optimizer="sgd",
                   store=store, prestart=False)
    ctx = _ctx(job)
    prof = _profile(ctx)  # the true profile, cached; then made wrong in the cache
    cache = ProfileCache(ctx.open_durable)
    key = store_key(model_key(ctx, prof["identity"], prof["microbatch_size"]), ctx.store_ref, pipeline=True)
    probe = cache.get("stores", key)
    # slow enough that Local-SGD's averaging loses to a free pipeline at first (about 0.67 s against
    # 0.52 s an epoch here), fast enough that it wins clearly once the pipeline's real transfers are
    # measured (against about 1.3 s): both margins well past the re-plan's 10 %
    probe.update(bandwidth_bytes_per_s=1e6, latency_s=0.02, checkpoint_s=0.05, contention=1.0,
                 transfer={"put_latency_s": 1e-7, "put_bandwidth": 1e13, "get_latency_s": 1e-7,
                           "get_bandwidth": 1e13, "handoff_s": 0.0})
    cache.put("stores", key, probe)

    summary = train(job)
    assert summary.status == "completed"
    first, second = summary.epochs[0], summary.epochs[1]
    assert summary.plan["strategy"] == "pipeline"  # what the wrong profile chose
    assert first.replan.switched and first.replan.reason.startswith("faster")
    assert first.replan.calibration["transfer_scale"] > 100
    assert first.replan.to["strategy"] == "local_sgd"
    assert (second.stages, second.workers) == (1, 2)  # Local-SGD on the same worker budget
    assert second.seconds < first.seconds


def test_a_run_that_adds_workers_in_advance_is_predicted_epoch_by_epoch():
    """adabatch 1 -> 2 -> 4: each added worker starts during the epoch before its own (billed
    from its launch, the start-up that epoch and its gap leave uncovered is waited for) and pays
    the warm-up; a run that keeps its plan throughout is the one-plan prediction."""
    one, two, four = (_plan(data_parallel=d, predicted_compute_epoch_s=c, price_per_worker_s=1.0)
                      for d, c in ((1, 4.0), (2, 2.0), (4, 1.0)))
    terms = RunTerms(startup_s=5.0, epoch_overhead_s=0.5, gap_s=0.3, provision_s=1.0, teardown_s=2.0,
                     stop_s=1.0, warmup_s=0.7, exposed_s=0.0)
    p = predict_run(one, terms, epochs=3, warm=True, workers_launched_s=None, per_epoch=[one, two, four],
                    coordinator_price_per_s=0.0)
    e0 = 4.5 + 0.7  # the first epoch: warm-up, no start-up left (exposed 0)
    e1 = 2.5 + 0.0 + 0.7  # 1 added worker, started during e0 + gap (5.5 s > 5 s start-up): nothing waited
    e2 = 1.5 + (5.0 - (e1 + 0.3)) + 0.7  # 2 added, started during e1 + gap (3.5 s): 1.5 s waited for
    assert p.first_epoch_s == pytest.approx(e0)
    assert p.run_s == pytest.approx(1.0 + e0 + 0.3 + e1 + 0.3 + e2 + 2.0)
    worker_s = (1 * (1.0 + e0)                              # epoch 0: one worker, billed from the plan on
                + 1 * (0.3 + e1) + 1 * (5.0 + e1)           # epoch 1: one kept, one added (launched 5 s early)
                + 2 * (0.3 + e2) + 2 * (5.0 - 1.5 + e2)     # epoch 2: two kept, two added (3.5 s early)
                + 4 * 1.0)                                  # all four stop
    assert p.worker_s == pytest.approx(worker_s)
    assert p.cost_usd == pytest.approx(worker_s)
    assert list(p.cost_by_epoch_usd)[-1] == pytest.approx(worker_s - 4 * 1.0)
    same = predict_run(two, terms, epochs=3, warm=True, workers_launched_s=None, per_epoch=[two] * 3)
    assert same == predict_run(two, terms, epochs=3, warm=True, workers_launched_s=None)
    with pytest.raises(ValueError, match="^per_epoch: must hold one plan per epoch"):
        predict_run(one, terms, epochs=2, warm=True, workers_launched_s=None, per_epoch=[one])


def test_workers_added_together_on_shared_cores_start_slower():
    """Where the added workers share the coordinator's cores, n starting at once each get
    cores / (n + 1) of them: one worker's start-up stretches by (n + 1) / cores when above 1,
    never below the slowest start-up measured; on machines of their own nothing stretches."""
    from planners.run_prediction import RunTerms, predict_run, started_together

    terms = RunTerms(startup_s=4.0, startup_one_s=3.0, epoch_overhead_s=0.5, gap_s=0.3, provision_s=1.0,
                     teardown_s=2.0, stop_s=1.0, warmup_s=0.7, exposed_s=0.0)
    assert started_together(terms, 1, 2) == 4.0  # 3 s x 1.0: the slowest measured wins
    assert started_together(terms, 2, 2) == pytest.approx(4.5)  # 3 s x 3/2
    assert started_together(terms, 4, 2) == pytest.approx(7.5)  # 3 s x 5/2
    assert started_together(terms, 4, None) == 4.0 and started_together(terms, 3, 16) == 4.0
    one, two, four = (_plan(data_parallel=d, predicted_compute_epoch_s=c, price_per_worker_s=1.0)
                      for d, c in ((1, 4.0), (2, 2.0), (4, 1.0)))
    alone = predict_run(one, terms, epochs=3, warm=True, workers_launched_s=None, per_epoch=[one, two, four])
    shared = predict_run(one, terms, epochs=3, warm=True, workers_launched_s=None, per_epoch=[one, two, four],
                         host_cores=2)
    e1 = 2.5 + 0.7  # 1 added: 4 s start-up, hidden behind epoch 0 (5.2 s) and the gap
    e2_alone = 1.5 + (4.0 - (e1 + 0.3)) + 0.7  # 2 added, 4 s each
    e2_shared = 1.5 + (4.5 - (e1 + 0.3)) + 0.7  # 2 added on 2 shared cores: 4.5 s
    assert shared.run_s - alone.run_s == pytest.approx(e2_shared - e2_alone)
    # launched at the same moment (the epoch before), all four of epoch 2 wait 0.5 s more, billed
    assert shared.worker_s - alone.worker_s == pytest.approx(4 * 0.5)


def test_an_adabatch_plan_predicts_each_budget_the_policy_will_run(tmp_path):
    """The first plan of an adabatch job predicts the run as the policy will run it: the budget
    doubles every epoch up to max_workers, each budget planned as the flow will plan it, and the
    bill is the per-epoch prediction's (more than the same job kept at one worker)."""
    from coordinator.plan.planning import make_plan
    from coordinator.plan.scaling_policy import worker_schedule
    from coordinator.plan.target_profile import catalog_profile
    from coordinator.run.context import RunContext
    from coordinator.run.validate import validate_job

    def context(scaling):
        job = TrainJob(model="digits_mlp", workers=1, max_workers=4, scaling=scaling, scale_every_epochs=1,
                       epochs=4, store=f"file://{tmp_path}/store")
        return RunContext(run_id="zada", job=job, resolved=validate_job(job), dry_run=True)

    ctx = context("adabatch")
    prof, _ = catalog_profile(ctx)  # nothing rented: the catalog's figures
    assert worker_schedule(ctx, 1, 4) == [1, 2, 4, 4] and worker_schedule(ctx, 2, 2) == [2, 4]
    plan = make_plan(ctx, prof, 1, None, 4)
    expected = [1] + [make_plan(ctx, prof, c, None, 0).workers for c in (2, 4, 4)]
    assert list(plan.predicted_workers_by_epoch) == expected and expected[-1] > 1
    [row] = [a for a in plan.alternatives if a.get("chosen")]
    assert row["predicted_run_cost_usd"] == plan.predicted_run_cost_usd
    static = context("static")
    kept = make_plan(static, prof, 1, None, 4)
    assert kept.predicted_workers_by_epoch == () and kept.predicted_run_cost_usd < plan.predicted_run_cost_usd
    assert worker_schedule(context("reactive"), 1, 4) is None  # decided by what epochs measure


def test_a_first_runs_epoch_overhead_comes_from_what_its_profile_measured(tmp_path):
    """Before any epoch, the per-epoch overhead is the profile's command round trip to a ready
    worker, rank 0's validation pass and the checkpoint write, marked as from the profile; a term
    the target measured in earlier runs wins, and one nothing measured stays assumed."""
    from coordinator.plan.profile_cache import ProfileCache
    from coordinator.plan.run_terms import load_terms, timings_key
    from coordinator.report.report import run_terms_text
    from coordinator.run.context import RunContext
    from coordinator.run.validate import validate_job

    job = TrainJob(model="digits_mlp", workers=2, store=f"file://{tmp_path}/store")
    ctx = RunContext(run_id="zterms", job=job, resolved=validate_job(job))
    assert load_terms(ctx).measured["epoch_overhead_s"] is False  # no profile taken: assumed
    ctx.state.profile = {"batch_size": 16, "microbatch_size": 4, "forward_s": 0.002, "checkpoint_s": 0.01}
    ctx.state.dispatch_samples = [0.3, 0.1, 0.2]
    terms = load_terms(ctx)
    assert terms.epoch_overhead_s == pytest.approx(0.2 + 0.002 / 4 * ctx.resolved.n_val + 0.01)
    assert terms.measured["epoch_overhead_s"] == "profile" and terms.measured["warmup_s"] is False
    text = run_terms_text(terms.to_dict())
    assert "epoch overhead" in text and "(from the profile)" in text and "warm-up 100 ms (assumed)" in text
    ProfileCache(ctx.open_durable).put("timings", timings_key(ctx), {"epoch_overhead_s": [0.7, 0.9]})
    again = load_terms(ctx)
    assert again.epoch_overhead_s == pytest.approx(0.8) and again.measured["epoch_overhead_s"] is True


def test_a_failed_profile_request_waits_for_the_other_and_bills_it_as_profile(tmp_path):
    """Of two profile requests sent at once, the model profile fails (the input does not fit
    the model) while the store probe runs on: the error is raised once the probe has answered,
    its interval billed as `profile` (not as idle under the next command), and both workers
    take the next request."""
    from coordinator.plan.target_profile import profile_request
    from coordinator.workers.warm_pool import WarmPool, provisional_plan

    ctx = _ctx(TrainJob(model="digits_mlp", workers=2, store=f"file://{tmp_path}/store", warm=True))
    pool = ctx.state.warm = WarmPool(ctx)
    try:
        plan = provisional_plan(ctx)
        pool.ensure(plan, 0)
        bad = profile_request(ctx, model_profile=True, store_probe=False).to_dict()
        bad["input_shape"] = [3]  # digits_mlp takes 64 features
        probe = profile_request(ctx, model_profile=False, store_probe=True).to_dict()
        with pytest.raises(RuntimeError, match="profiling on worker .* failed"):
            pool.profile(plan, [bad, probe], timeout_s=120)
        rows = {r.rank: r for r in ctx.state.ledger if r.status == "profile"}
        assert set(rows) == {0, 1}
        assert rows[1].stop > rows[0].stop  # the probe outlasted the failure, and was billed as such
        again = pool.profile(plan, [probe, probe], timeout_s=120)
        assert all(answer["store"]["bandwidth_bytes_per_s"] > 0 for answer in again)
    finally:
        pool.stop_all("the test is over")

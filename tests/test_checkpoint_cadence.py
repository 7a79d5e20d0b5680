"""Sync checkpoints by Young's interval (`planners.checkpoint_cadence`, `SyncSpec.checkpoint_interval_s`):
the interval minimises a checkpoint's cost plus a crash's expected loss, spot interruptions count
only where the notice leaves no time to hand over; a K-AVG epoch over the store shorter than the
interval then writes no sync checkpoint (one when the rounds kept reach their bound), and a replica
killed mid-epoch with nothing handed over is relaunched, replays every round since the epoch's
start and ends on the uninterrupted run's weights. Replicas run as threads, in float64."""
from __future__ import annotations

import dataclasses
import math

import pytest

import engine.local_sgd_epoch as local_sgd_epoch
from comm.store_dir import DirectoryStore
from core.keys import sync_checkpoint_key
from core.specs import SyncSpec
from engine.local_sgd_epoch import read_epoch_history
from engine.models import build_model
from planners.checkpoint_cadence import (MAX_INTERVAL_S, MIN_INTERVAL_S, checkpoints_per_epoch,
                                         rounds_between_checkpoints, sync_checkpoint_interval_s, young_interval_s)
from tests.memory_store import MemoryStore
from tests.test_gradient_buckets import (assert_same_state, final_state, rank_1_dies_and_is_relaunched,
                                         run_threads, specs, stage)

PRICE = 0.0494 / 3600  # a Fargate worker of 1 vCPU and 2 GB, dollars a second


def test_young_interval_minimises_the_checkpoints_cost_plus_the_expected_redo():
    cost_s, rate = 0.3, 4 / 3600.0  # a 0.3 s stall a checkpoint; 4 hard failures an hour
    best = young_interval_s(cost_s, rate)
    assert best == pytest.approx(math.sqrt(2 * cost_s / rate))

    def loss(t):
        return cost_s / t + rate * t / 2
    assert all(loss(best) < loss(best * f) for f in (0.5, 0.9, 1.1, 2.0))
    assert young_interval_s(cost_s, 0.0) == math.inf


def test_the_interval_counts_the_requests_price_and_only_the_failures_that_hand_nothing_over():
    base = dict(workers=4, checkpoint_s=0.05, put_usd=5e-6, price_per_worker_s=PRICE)
    on_demand = sync_checkpoint_interval_s(**base)
    # the put's $5e-6 is 0.09 s of 4 workers; with the stall, 0.14 s at 1 crash in 1,000 worker-hours
    assert on_demand == pytest.approx(math.sqrt(2 * (0.05 + 5e-6 / (4 * PRICE)) / (4 * 1e-3 / 3600)))
    # on spot with a notice to hand over in, the interruptions lose nothing: the same interval
    assert sync_checkpoint_interval_s(**base, spot_rate_per_worker_hour=30.0) == on_demand
    # with none, they are crashes: far shorter, and never under a second
    no_notice = sync_checkpoint_interval_s(**base, spot_rate_per_worker_hour=30.0, handover=False)
    assert no_notice == pytest.approx(math.sqrt(2 * (0.05 + 5e-6 / (4 * PRICE)) / (4 * 30.001 / 3600)))
    assert MIN_INTERVAL_S < no_notice < on_demand / 100
    assert sync_checkpoint_interval_s(**{**base, "checkpoint_s": 0.0, "put_usd": 0.0},
                                      spot_rate_per_worker_hour=1e6, handover=False) == MIN_INTERVAL_S
    assert sync_checkpoint_interval_s(**base, crash_rate_per_worker_hour=0.0) == MAX_INTERVAL_S


def test_checkpoints_per_epoch_one_an_interval_since_the_epochs_start():
    assert checkpoints_per_epoch(6, 5.0, 500.0) == 0  # the epoch checkpoint stands in for the last round's
    assert checkpoints_per_epoch(6, 50.0, 20.0) == 2
    assert checkpoints_per_epoch(6, 60.0, 20.0) == 3
    assert checkpoints_per_epoch(6, 500.0, 1.0) == 6
    assert checkpoints_per_epoch(6, 5.0, 0.0) == 6  # by rounds
    assert checkpoints_per_epoch(0, 5.0, 1.0) == 0


def test_a_compressed_syncs_interval_is_the_rounds_it_holds_at_the_plans_pace():
    assert rounds_between_checkpoints(20.0, 5.0, 19) == 76  # an epoch of 19 rounds in 5 s: 3.8 rounds a second
    assert rounds_between_checkpoints(2.0, 5.0, 19) == 7
    assert rounds_between_checkpoints(0.1, 5.0, 19) == 1  # never fewer than one round
    assert rounds_between_checkpoints(0.0, 5.0, 19) == 1  # the job's 0: every round
    assert rounds_between_checkpoints(20.0, 0.0, 19) == 1  # no pace predicted: every round
    assert rounds_between_checkpoints(math.inf, 5.0, 19) == 19  # nothing expected to fail: the last round's alone


def kavg(store, run_id, optimizer, sync):
    """K-AVG every 2 steps: 3 rounds in the epoch of STEPS 6."""
    return [dataclasses.replace(s, sync_period=2) for s in specs(store, run_id, optimizer, sync)]


@pytest.mark.parametrize("cadence, checkpoints, resumes_at", [("by rounds", 3, {2, 4}), ("by the interval", 0, {0}),
                                                              ("by the bytes kept", 1, {0, 4})])
def test_a_kavg_replica_killed_mid_epoch_ends_equal_whatever_the_cadence(tmp_path, monkeypatch, cadence,
                                                                         checkpoints, resumes_at):
    """Rank 1 dies as it posts its piece of round 2 (of 0, 1, 2); its relaunch resumes from the last
    sync checkpoint stored (every round: after round 1, step 4, or round 0 while round 1's is
    still in flight; by an interval no epoch reaches: the epoch's start, no sync checkpoint
    written (the last round is not due as such); by the rounds kept reaching `REPLAY_KEPT_BYTES`,
    here two rounds' worth: round 1's written, resumed after it or from the start) and replays the
    rounds since: the rounds up to the previous checkpoint's are deleted only once the next is stored."""
    interval = 0.0 if cadence == "by rounds" else 3600.0
    sync = SyncSpec(repost_s=0.5, checkpoint_interval_s=interval)
    monkeypatch.setattr(local_sgd_epoch, "checkpoint_clock", lambda: 0.0)  # no second ever passes
    if cadence == "by the bytes kept":
        params = sum(p.numel() * 8 for p in build_model("digits_mlp", 0).parameters())
        monkeypatch.setattr(local_sgd_epoch, "REPLAY_KEPT_BYTES", 2 * 3 * params)  # two rounds' worth
    reference = DirectoryStore(tmp_path / "ref")
    stage(reference, "k", "momentum")
    run_threads(reference, kavg(reference, "k", "momentum", SyncSpec()))

    clean = MemoryStore()
    stage(clean, "k", "momentum")
    run_threads(clean, kavg(clean, "k", "momentum", sync))
    assert clean.puts.count(sync_checkpoint_key("k", 0)) == checkpoints

    store = MemoryStore()
    stage(store, "k", "momentum")
    rank_1_dies_and_is_relaunched(store, kavg(store, "k", "momentum", sync), lambda key: "/sync/e0/r2/" in key)
    assert_same_state(final_state(store, "k", "momentum"), final_state(reference, "k", "momentum"), 1e-12)
    relaunch = next(h for h in read_epoch_history(store, "k", 0) if h["attempt"] == 1)
    assert relaunch["start_step"] in resumes_at
    assert store.list("runs/k/sync/") == []


def test_a_compressed_sync_keeps_checkpointing_by_rounds(monkeypatch):
    """Every rank writes its residual on the checkpoint's rounds, so they must agree: no clock;
    the coordinator's count of rounds (`SyncSpec.checkpoint_every`), at most as many as the
    store keeps for a replay (`REPLAY_KEPT_BYTES` of the rounds' wire)."""
    model = build_model("digits_mlp", 0)
    spec = kavg(MemoryStore(), "c", "sgd", SyncSpec(checkpoint_interval_s=3600.0, sync_dtype="int8"))[0]
    cadence = local_sgd_epoch.cadence_for(spec, model, None)
    assert [cadence.due(r, 2 * (r + 1)) for r in range(3)] == [True, True, True]
    spec = dataclasses.replace(spec, steps=40, sync=SyncSpec(checkpoint_every=1000, sync_dtype="int8"))
    cadence = local_sgd_epoch.cadence_for(spec, model, None)
    assert [r for r in range(20) if cadence.due(r, 2 * (r + 1))] == [19]  # the last round's alone
    params = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(local_sgd_epoch, "REPLAY_KEPT_BYTES", 5 * 3 * params // 4 + 1000)  # 5 int8 rounds' worth
    cadence = local_sgd_epoch.cadence_for(spec, model, None)
    assert [r for r in range(20) if cadence.due(r, 2 * (r + 1))] == [4, 9, 14, 19]


def test_the_plan_carries_the_interval_and_predicts_its_epochs_checkpoints(tmp_path, monkeypatch):
    """`with_checkpoint_interval`: Young's interval for a K-AVG plan over S3 (the profiled stall,
    one PUT of the checkpoint at the plan's price; a compressed sync's counts each rank's residual
    too); none for the ring; the epoch's predicted requests count no sync checkpoint where the
    interval outlasts the epoch, against one a round without it, and a compressed sync's the
    last round's alone (its checkpoint and 4 residuals), where it wrote 5 a round before."""
    from types import SimpleNamespace

    from coordinator.plan.planning import RunStores, with_checkpoint_interval
    from core.plan import Plan
    from core.store_ops import StoreOps
    from planners.catalog import get_offer
    from planners.store_prices import store_offer
    from planners.store_requests import epoch_store_ops
    from tests.test_spot import _ctx

    ctx = _ctx(tmp_path, capacity="spot", monkeypatch=monkeypatch)
    object.__setattr__(ctx, "job", SimpleNamespace(**vars(ctx.job), optimizer="momentum"))
    ctx.state.profile = {"checkpoint_s": 0.05, "param_bytes": 1e6}
    s3 = store_offer("s3://bucket")
    stores = RunStores(roles={"s3://bucket": "durable"}, offers={"durable": s3}, channel_poll_s=0.05)
    price = get_offer("fargate-cpu").price_per_s(1.0, 2.0)
    plan = Plan(strategy="local_sgd", data_parallel=4, steps_per_epoch=48, sync_period=8,
                price_per_worker_s=price, predicted_epoch_s=5.0)
    put_usd = s3.request_usd(StoreOps(put=1))
    want = sync_checkpoint_interval_s(workers=4, checkpoint_s=0.05, put_usd=put_usd, price_per_worker_s=price)
    got = with_checkpoint_interval(ctx, plan, stores)
    assert got.sync_checkpoint_s == pytest.approx(want, rel=1e-12) and want > 100  # Fargate Spot gives 120 s notice
    int8 = with_checkpoint_interval(ctx, dataclasses.replace(plan, sync_dtype="int8"), stores)
    want_int8 = sync_checkpoint_interval_s(workers=4, checkpoint_s=0.05, put_usd=5 * put_usd, price_per_worker_s=price)
    assert int8.sync_checkpoint_s == pytest.approx(want_int8, rel=1e-12) and want_int8 > want
    every_round = dataclasses.replace(int8, sync_checkpoint_s=0.0)
    assert epoch_store_ops(every_round).put - epoch_store_ops(int8).put == 5 * 6 - 5
    object.__setattr__(ctx, "job", SimpleNamespace(**{**vars(ctx.job), "collective": "ring"}))
    assert with_checkpoint_interval(ctx, plan, stores).sync_checkpoint_s == 0
    by_rounds, by_interval = epoch_store_ops(plan), epoch_store_ops(got)
    assert by_rounds.put - by_interval.put == 6  # 6 rounds: 6 checkpoints, against none (the epoch's is its last)


@pytest.mark.parametrize("sync_dtype, listings", [("float32", 1), ("int8", 5)])
def test_pruning_lists_the_checkpoints_once_per_coordinator_and_keeps_what_a_listing_would(tmp_path, sync_dtype,
                                                                                           listings):
    """Five epochs committed and retired (`commit_checkpoint`, `retire_checkpoints`), keeping
    2: the same checkpoints are left as when every epoch lists them, with one listing in all; a
    compressed sync, whose workers write residual keys of their own, lists each epoch."""
    from types import SimpleNamespace

    from coordinator.run.context import RunState
    from coordinator.workers.retention import commit_checkpoint, retire_checkpoints
    from core.epoch_summary import EpochSummary
    from core.keys import checkpoint_key
    from engine.checkpoint import initial_checkpoint

    store = DirectoryStore(tmp_path / "store")
    initial_checkpoint(store, "runs/p/ckpt/init.safetensors", "digits_mlp", "sgd", lr=0.1)
    blob = store.get("runs/p/ckpt/init.safetensors")
    job = SimpleNamespace(target_loss=None, target_accuracy=None, keep_checkpoints=2, sync_dtype=sync_dtype)
    ctx = SimpleNamespace(run_id="p", job=job, state=RunState(), open_durable=lambda: store)
    store.close = lambda: None
    before = store.ops.list
    for epoch in range(5):
        store.put(checkpoint_key("p", epoch), blob)
        if epoch % 2:  # an epoch long enough for a mid-epoch sync checkpoint
            store.put(sync_checkpoint_key("p", epoch), blob)
        summary = EpochSummary(epoch=epoch, workers=2, train_loss=1.0, seconds=1.0,
                               checkpoint_key=checkpoint_key("p", epoch))
        commit_checkpoint(ctx, summary)
        retire_checkpoints(ctx, summary)
    assert store.ops.list - before == listings
    left = sorted(k.rsplit("/", 1)[1] for k in store.list("runs/p/ckpt/"))
    assert left == ["epoch-0003.safetensors", "epoch-0004.safetensors", "init.safetensors"]
    assert ctx.state.checkpoint_keys >= {checkpoint_key("p", 3), checkpoint_key("p", 4)}


@pytest.mark.parametrize("sync_dtype", ["float32", "int8", "bfloat16"])
def test_the_workers_get_the_plans_cadence_in_seconds_or_for_a_compressed_sync_in_rounds(sync_dtype):
    """A float32 sync is given the interval (rank 0 alone decides by its clock); a compressed one
    the rounds the interval holds at the plan's pace, the same count for every rank."""
    from types import SimpleNamespace

    from coordinator.run.job import TrainJob
    from coordinator.workers.worker_specs import worker_specs
    from core.plan import Plan

    job = TrainJob(workers=2, sync_period=8, sync_dtype=sync_dtype, optimizer="momentum")
    ctx = SimpleNamespace(job=job, run_id="zcad", store_ref="file:///tmp/s", durable_ref="file:///tmp/d",
                          resolved=SimpleNamespace(target=SimpleNamespace(remote=False, kind="inline"), model_kwargs={}),
                          state=SimpleNamespace(dataset={"n_train": 4864}))
    plan = Plan(strategy="local_sgd", data_parallel=2, batch_size=16, sync_period=8, sync_dtype=sync_dtype,
                predicted_epoch_s=3.8, sync_checkpoint_s=2.0)  # 152 steps: 19 rounds in 3.8 s, 5 a second
    specs = worker_specs(ctx, plan, epoch=0, init="", lr=0.05, attempt=0)
    cadences = {(s.sync.checkpoint_every, s.sync.checkpoint_interval_s) for s in specs}
    assert cadences == ({(1, 2.0)} if sync_dtype == "float32" else {(10, 0.0)})

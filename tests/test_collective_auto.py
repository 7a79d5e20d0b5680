"""`collective=auto` (issue #45 item 3): the planner compares the store collectives and the ring
for each plan of several replicas by epoch time and dollars, the store's requests included (the
ring makes none), and considers the ring only where it may run. Every number here is derived by
hand from the time models (`planners.sync_time`) and the protocols (`planners.store_requests`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.report.report import alternatives_table
from coordinator.run.collective import planned_collectives, ring_refusal, uses_ring
from coordinator.run.job import TrainJob
from core.kinds import Capacity, Strategy, TargetKind
from core.plan import Plan
from planners.store_prices import S3_STANDARD
from planners.strategy import StrategyInputs, candidates, choose, epoch_usd, store_request_usd

PRICE = 1e-5  # dollars per worker-second
S3_PUT, S3_GET = 0.005 / 1000, 0.0004 / 1000


def inputs(**kw) -> StrategyInputs:
    """4 replicas averaging every step: 1792 samples, batch 16: 28 steps of 0.1 s; 100 KB of
    gradients a sync; the store's link 100 MB/s, 1 ms; the ring's 100 MB/s, 1.5 ms a hop; no sync
    checkpoint time, so the two plans differ in their collective alone."""
    return StrategyInputs(**{**dict(
        layers=(), profile_batch=16, step_s=0.1, param_bytes=1e5, optimizer_copies=1, n_train=1792, batch_size=16,
        workers=4, stages=None, microbatches=None, sync_period=1, bandwidth=1e8, latency=1e-3, offer="fargate",
        price_per_worker_s=PRICE, checkpoint_s=0.0, collectives=("store", "ring"), ring_link=(1e8, 1.5e-3)), **kw})


# by hand: the store's scatter-reduce of 1e5 bytes among 4 (FuncPipe Eq. 1):
# 3 s/w - 2 s/(n w) + 4 lat = 3e-3 - 0.5e-3 + 4e-3 = 6.5 ms; the ring: 2 (4 - 1) hops of
# 25,000 bytes at 1e8 B/s plus 1.5 ms each = 6 x 1.75 ms = 10.5 ms
STORE_EPOCH_S = 28 * (0.1 + 6.5e-3)  # 2.982 s
RING_EPOCH_S = 28 * (0.1 + 10.5e-3)  # 3.094 s: 3.8 % slower, within the 5 % of near throughput
# the requests of an epoch (tests/test_store_weighed.py derives the store's): every step 485 PUT,
# 679 GET, 29 LIST; over the ring the initial reads (4 GET), the history records and the epoch
# checkpoint (5 PUT), the last round's sync checkpoint (1 PUT), the ring's rendezvous (1 PUT, 3 GET)
# and its release (4 PUT, 3 GET, 2 LIST)
STORE_REQUESTS_USD = (485 + 29) * S3_PUT + 679 * S3_GET
RING_REQUESTS_USD = (11 + 2) * S3_PUT + 10 * S3_GET


def test_request_prices_flip_the_collective_auto_chooses():
    free = choose(inputs(), Strategy.LOCAL_SGD)
    s3 = choose(inputs(store_request_usd=S3_STANDARD.prices()), Strategy.LOCAL_SGD)
    # a free store: the workers' dollars alone, 2.982 x 4 x 1e-5 against 3.094 x 4 x 1e-5: the store
    assert free.collective == "store"
    assert free.predicted_epoch_s == pytest.approx(STORE_EPOCH_S, rel=1e-12)
    assert free.predicted_cost_per_epoch_usd == pytest.approx(STORE_EPOCH_S * 4 * PRICE, rel=1e-12)
    # S3's prices: $0.11928m + $2.8416m against $0.12376m + $0.069m: the ring
    assert s3.collective == "ring"
    assert s3.predicted_epoch_s == pytest.approx(RING_EPOCH_S, rel=1e-12)
    x = inputs(store_request_usd=S3_STANDARD.prices())
    store_plan = next(p for p in choose(x, Strategy.LOCAL_SGD).alternatives if p["collective"] == "store")
    assert store_plan["predicted_store_usd_per_epoch"] == pytest.approx(STORE_REQUESTS_USD, rel=1e-12)
    assert store_request_usd(x, s3) == pytest.approx(RING_REQUESTS_USD, rel=1e-12)
    assert epoch_usd(x, s3) == pytest.approx(RING_EPOCH_S * 4 * PRICE + RING_REQUESTS_USD, rel=1e-12)
    # both plans are in the alternatives, each with its collective and its store dollars
    rows = {(a["collective"], a["chosen"]): a for a in s3.alternatives}
    assert set(rows) == {("store", False), ("ring", True)}
    assert rows[("ring", True)]["predicted_store_usd_per_epoch"] == pytest.approx(RING_REQUESTS_USD, rel=1e-12)


def test_a_ring_more_than_5_percent_slower_is_not_chosen_for_its_free_requests():
    # a 5 ms hop: 6 x 5.25 ms = 31.5 ms a sync, 28 x 0.1315 s = 3.682 s: 23 % slower than the store
    slow = choose(inputs(store_request_usd=S3_STANDARD.prices(), ring_link=(1e8, 5e-3)), Strategy.LOCAL_SGD)
    assert slow.collective == "store"
    ring = next(a for a in slow.alternatives if a["collective"] == "ring")
    assert ring["predicted_epoch_s"] == pytest.approx(28 * (0.1 + 6 * (25_000 / 1e8 + 5e-3)), rel=1e-12)


def test_one_replica_is_planned_once_and_the_job_s_own_collective_alone():
    one = choose(inputs(workers=1, n_train=448), Strategy.LOCAL_SGD)
    assert [a["collective"] for a in one.alternatives] == ["store"]  # nothing to average
    ring = choose(inputs(collectives=(), ring=True), Strategy.LOCAL_SGD)
    assert ring.collective == "ring" and [a["collective"] for a in ring.alternatives] == ["ring"]
    store = choose(inputs(collectives=()), Strategy.LOCAL_SGD)
    assert store.collective == "store" and len(store.alternatives) == 1


def _job(**kw):
    return SimpleNamespace(**{"collective": "auto", "sync_dtype": "float32", "capacity": Capacity.ON_DEMAND, **kw})


@pytest.mark.parametrize("job, kind, why", [
    (_job(sync_dtype="int8"), TargetKind.INLINE, "sync_dtype int8 travels through the store"),
    (_job(sync_dtype="bfloat16"), TargetKind.PROCESS, "sync_dtype bfloat16 travels through the store"),
    (_job(), TargetKind.ECS, "workers on target kind ecs are not known to reach each other"),
    (_job(), TargetKind.ACI, "workers on target kind aci are not known to reach each other"),
    (_job(capacity=Capacity.SPOT), TargetKind.INLINE, "capacity spot: a reclaimed worker is relaunched alone"),
])
def test_auto_keeps_the_store_where_the_ring_may_not_run(job, kind, why):
    target = SimpleNamespace(kind=kind)
    assert ring_refusal(job, target).startswith(why)
    collectives, note = planned_collectives(job, target)
    assert collectives == ("store",) and note.startswith(why)


def test_auto_compares_both_on_this_machine_and_a_named_collective_is_kept():
    for kind in (TargetKind.INLINE, TargetKind.PROCESS):
        assert planned_collectives(_job(), SimpleNamespace(kind=kind)) == (("store", "ring"), "")
    ecs = SimpleNamespace(kind=TargetKind.ECS)
    assert planned_collectives(_job(collective="ring"), ecs) == (("ring",), "")
    assert planned_collectives(_job(collective="store", sync_dtype="int8"), ecs) == (("store",), "")


def test_the_workers_follow_the_plan_s_collective():
    ring, store = Plan(strategy=Strategy.LOCAL_SGD, data_parallel=4, collective="ring"), \
        Plan(strategy=Strategy.LOCAL_SGD, data_parallel=4)
    assert uses_ring(_job(), ring) and not uses_ring(_job(), store)
    assert uses_ring(_job(collective="ring"), store)  # a plan made without it (the co-optimiser's)
    assert not uses_ring(_job(collective="store"), ring)


def test_the_job_takes_auto_and_still_refuses_a_compressed_ring():
    assert TrainJob(collective="auto", sync_dtype="int8").collective == "auto"
    assert TrainJob().collective == "store"
    with pytest.raises(ValueError, match="sync_dtype"):
        TrainJob(collective="ring", sync_dtype="int8")


def test_the_alternatives_table_names_each_plan_s_collective():
    plan = choose(inputs(store_request_usd=S3_STANDARD.prices()), Strategy.LOCAL_SGD).to_dict()
    lines = alternatives_table(plan, markdown=True)
    assert "| collective |" in lines[0]
    assert [line.split(" | ")[3] for line in lines[2:4]] == ["store", "ring"]
    assert lines[3].startswith("| chosen |")


def test_a_hybrid_over_the_ring_syncs_each_stage_by_the_ring_model():
    from planners.strategy import pipeline_prediction
    from planners.sync_time import ring_allreduce

    x = StrategyInputs(layers=tuple({"forward_s": 0.01, "backward_s": 0.02, "output_bytes": 4096.0,
                                     "param_bytes": 4e6} for _ in range(4)),
                       profile_batch=32, step_s=0.12, param_bytes=16e6, optimizer_copies=0, n_train=4096,
                       batch_size=32, workers=4, stages=2, microbatches=4, sync_period=1, bandwidth=1e9,
                       latency=1e-3, offer="aci-cpu", price_per_worker_s=1e-5, collectives=("store", "ring"),
                       ring_link=(1.5e9, 1e-4))
    plans = list(choose(x, "hybrid").alternatives)
    assert sorted(a["collective"] for a in plans) == ["ring", "store"]
    ring = next(p for p in candidates(x, "hybrid")
                if p.collective == "ring")
    syncs = [i.end - i.start for row in pipeline_prediction(x, ring).simulation.timelines
             for i in row if i.resource == "sync"]
    # each stage's two 4 MB layers among the 4 replicas: 6 hops of 2 MB at 1.5 GB/s plus 0.1 ms
    assert syncs == pytest.approx([ring_allreduce(8e6, 4, 1.5e9, 0.0, 1e-4)] * 2)
    assert syncs[0] == pytest.approx(6 * (2e6 / 1.5e9 + 1e-4))


def test_a_pipeline_s_requests_are_priced_by_the_durable_store_its_stages_use():
    # the stages of a pipeline move activations through the durable store (worker_specs): with a
    # directory as the durable store and S3 as the run's, a hybrid's requests cost nothing and
    # Local-SGD's are S3's
    x = inputs(store_request_usd=S3_STANDARD.prices(), pipeline_store_request_usd={})
    hybrid = Plan(strategy=Strategy.HYBRID, data_parallel=2, stages=2, cuts=(1,), microbatches=2, sync_period=1,
                  steps_per_epoch=28, batch_size=32)
    assert store_request_usd(x, hybrid) == 0.0
    assert store_request_usd(inputs(store_request_usd=S3_STANDARD.prices()), hybrid) > 0.0
    every_step = choose(x, Strategy.LOCAL_SGD)
    assert next(a for a in every_step.alternatives if a["collective"] == "store")[
        "predicted_store_usd_per_epoch"] == pytest.approx(STORE_REQUESTS_USD, rel=1e-12)

"""The planner weighs the store's dollars (issue #45 item 3): among plans of near throughput it
picks the cheapest epoch, workers and store requests together, so request prices can change
the chosen plan; the counts and bills here are derived by hand from the protocols
(`planners.store_requests`)."""
from __future__ import annotations

import pytest

from core.kinds import Strategy
from core.plan import Plan
from planners.store_prices import AZURE_BLOB_HOT, S3_STANDARD
from planners.store_requests import epoch_store_ops
from planners.strategy import StrategyInputs, describe, epoch_usd, fastest_cheapest, store_request_usd

PRICE = 1e-5  # dollars per worker-second
S3_PUT, S3_GET = 0.005 / 1000, 0.0004 / 1000


def inputs(**store) -> StrategyInputs:
    return StrategyInputs(layers=(), profile_batch=16, step_s=0.1, param_bytes=1e5, optimizer_copies=1,
                          n_train=1792, batch_size=16, workers=4, stages=None, microbatches=None, sync_period=1,
                          bandwidth=1e8, latency=1e-3, offer="fargate", price_per_worker_s=PRICE, **store)


def every_step() -> Plan:
    """Local-SGD, D = 4, averaging every step: 28 steps of 0.100 s."""
    return Plan(strategy=Strategy.LOCAL_SGD, data_parallel=4, sync_period=1, steps_per_epoch=28, batch_size=16,
                price_per_worker_s=PRICE, predicted_iteration_s=0.100, predicted_epoch_s=2.8,
                predicted_cost_per_epoch_usd=2.8 * 4 * PRICE)


def hybrid() -> Plan:
    """2 replicas of a 2-stage pipeline, 2 micro-batches: 28 steps of 0.104 s (within 5 % of the
    throughput), dearer in worker-seconds."""
    return Plan(strategy=Strategy.HYBRID, data_parallel=2, stages=2, cuts=(1,), microbatches=2, sync_period=1,
                steps_per_epoch=28, batch_size=32, price_per_worker_s=PRICE, predicted_iteration_s=0.104,
                predicted_epoch_s=2.912, predicted_cost_per_epoch_usd=2.912 * 4 * PRICE)


def test_each_plans_requests_by_hand():
    # every step: 28 rounds of 4 ranks (4 puts, 6 gets, 3 deletes each; a replayed group keeps the
    # previous slice), the release, a sync checkpoint a round (dropping 27 rounds of 4 keys), 4
    # initial reads, 4 history records, the epoch checkpoint
    a = epoch_store_ops(every_step())
    assert (a.put, a.get, a.list, a.delete) == (1 + 4 + 448 + 4 + 28, 4 + 672 + 3, 2 + 27, 336 + 8 + 108)
    # hybrid: 2 replicas x 28 steps x 1 boundary x 2 micro-batches x 2 ways; 3 hand-offs; each of the
    # 4 stage workers' gradients averaged over 2 every step; a release per stage
    b = epoch_store_ops(hybrid())
    assert (b.put, b.get, b.list, b.delete) == (1 + 224 + 3 + 224 + 4, 4 + 224 + 3 + 224 + 2, 4, 224 + 3 + 220 + 8)


def test_request_prices_change_the_chosen_plan():
    a, b = every_step(), hybrid()
    free = inputs()
    assert fastest_cheapest(free, [a, b]) is a  # the workers alone: every-step Local-SGD is cheaper
    s3 = inputs(store_request_usd=S3_STANDARD.prices())
    # both bills, per epoch: the workers' and the S3 requests' (PUT and LIST at one price, GET another)
    a_store, b_store = (485 + 29) * S3_PUT + 679 * S3_GET, (456 + 4) * S3_PUT + 457 * S3_GET
    assert store_request_usd(s3, a) == pytest.approx(a_store, rel=1e-12)
    assert store_request_usd(s3, b) == pytest.approx(b_store, rel=1e-12)
    assert epoch_usd(s3, a) == pytest.approx(2.8 * 4 * PRICE + a_store, rel=1e-12)
    assert epoch_usd(s3, b) == pytest.approx(2.912 * 4 * PRICE + b_store, rel=1e-12)
    assert a.predicted_cost_per_epoch_usd < b.predicted_cost_per_epoch_usd and epoch_usd(s3, b) < epoch_usd(s3, a)
    assert fastest_cheapest(s3, [a, b]) is b
    assert fastest_cheapest(inputs(store_request_usd=AZURE_BLOB_HOT.prices()), [a, b]) is b
    # over the ring, the replicas' rounds leave the store: every step is cheaper again
    assert fastest_cheapest(inputs(store_request_usd=S3_STANDARD.prices(), ring=True), [a, b]) is a
    # the alternatives' rows carry each plan's store dollars
    assert describe(b, True, b_store)["predicted_store_usd_per_epoch"] == b_store


def test_a_store_server_is_weighed_by_the_epoch_it_runs():
    a, b = every_step(), hybrid()
    node = inputs(store_usd_per_s=0.05 / 3600)  # a cloud Redis node: requests free, the node by the second
    assert epoch_usd(node, a) == pytest.approx(2.8 * 4 * PRICE + 2.8 * 0.05 / 3600, rel=1e-12)
    assert fastest_cheapest(node, [a, b]) is a


def test_far_slower_plans_stay_out_however_cheap():
    a, b = every_step(), hybrid()
    slow = Plan(**{**b.__dict__, "predicted_iteration_s": 0.2, "alternatives": ()})
    assert fastest_cheapest(inputs(store_request_usd=S3_STANDARD.prices()), [a, slow]) is a


def test_the_alternatives_table_shows_each_plans_store_dollars_where_one_pays():
    from coordinator.report.report import alternatives_table

    s3 = inputs(store_request_usd=S3_STANDARD.prices())
    a, b = every_step(), hybrid()
    rows = [describe(a, False, store_request_usd(s3, a)), describe(b, True, store_request_usd(s3, b))]
    plan = {**rows[1], "alternatives": rows}
    lines = alternatives_table(plan, markdown=True)
    text = "\n".join(lines)
    assert "store $ / epoch" in lines[0]
    assert "| $0.00284 |" in text and "| $0.00248 |" in text
    free = [describe(a), describe(b, True)]
    assert "store $" not in "\n".join(alternatives_table({**free[1], "alternatives": free}, markdown=True))

"""The run's own store requests (`coordinator.plan.own_requests`): measured by one run beyond
its epochs' protocol, predicted for the next on the same target (issue #45)."""
from __future__ import annotations

import json

import pytest

from coordinator.plan import own_requests
from core.store_ops import StoreOps
from planners.store_prices import store_offer

S3, DIR, ELSEWHERE = "s3://run", "file://", "s3://dataset-bucket"
ROLES = {S3: "store", DIR: "durable"}


def snap(coordinator: dict, workers: dict) -> dict:
    """A snapshot of the run's requests so far: `{party: {where: StoreOps}}`."""
    return {"coordinator": {w: StoreOps(**o) for w, o in coordinator.items()},
            "workers": {w: StoreOps(**o) for w, o in workers.items()}}


def test_a_runs_samples_split_staging_steady_epochs_and_teardown():
    """Four epochs: the steady ones (second and third) are the `epoch` samples, each its requests
    less its prediction; the first's excess over their median joins staging; the last's, with
    everything after it, is teardown. A worker's misses on the protocol's store are left out (its
    waits for peers), the coordinator's and those on another role kept; a store that is neither
    of the run's is left out."""
    expected = {"workers": {"store": StoreOps(put=10, get=10, miss=7)}}  # misses of a protocol's store: dropped
    at_plan = snap({DIR: {"put": 5, "miss": 2}}, {})
    sends = [
        snap({DIR: {"put": 40, "head": 30, "miss": 2}}, {}),  # staging: 35 puts, 30 heads
        snap({DIR: {"put": 43, "head": 30, "miss": 4}, ELSEWHERE: {"get": 9}},
             {S3: {"put": 10, "get": 30, "miss": 50}, DIR: {"miss": 3}}),  # first epoch: 20 data reads more
        snap({DIR: {"put": 46, "head": 30, "miss": 6}, ELSEWHERE: {"get": 18}},
             {S3: {"put": 20, "get": 40, "miss": 90}, DIR: {"miss": 6}}),
        snap({DIR: {"put": 50, "head": 30, "miss": 8}, ELSEWHERE: {"get": 27}},
             {S3: {"put": 30, "get": 50, "miss": 140}, DIR: {"miss": 9}}),
    ]
    at_end = snap({DIR: {"put": 60, "head": 30, "miss": 8, "list": 6}, ELSEWHERE: {"get": 36}},
                  {S3: {"put": 40, "get": 60, "miss": 170}, DIR: {"miss": 12}})
    got = own_requests.samples(ROLES, at_plan, [(s, expected, "store") for s in sends], at_end)
    steady = [{"durable": {"put": 3, "get": 0, "miss": 5, "head": 0, "list": 0, "delete": 0},
               "store": {"put": 0, "get": 0, "miss": 0, "head": 0, "list": 0, "delete": 0}},
              {"durable": {"put": 4, "get": 0, "miss": 5, "head": 0, "list": 0, "delete": 0},
               "store": {"put": 0, "get": 0, "miss": 0, "head": 0, "list": 0, "delete": 0}}]
    assert got["epoch"] == steady
    term = own_requests.median(steady)  # put 3.5 rounds to 4 (banker's rounding: 4), miss 5
    assert term["durable"]["put"] == 4 and term["durable"]["miss"] == 5
    # staging: the plan to the first send (35 puts, 30 heads), plus the first epoch's excess over the
    # term: durable puts 3 - 4 and misses 2 + 3 - 5; the store's 20 extra data reads
    assert got["staging"] == [{"durable": {"put": 34, "get": 0, "miss": 0, "head": 30, "list": 0, "delete": 0},
                               "store": {"put": 0, "get": 20, "miss": 0, "head": 0, "list": 0, "delete": 0}}]
    # a dataset of 20 subset files staged: their existence checks and puts are the dataset's, not the run's
    staged = own_requests.samples(ROLES, at_plan, [(s, expected, "store") for s in sends], at_end,
                                  own_requests.staged_files(20, "durable"))
    assert staged["staging"][0]["durable"] == {**got["staging"][0]["durable"], "put": 14, "head": 10}
    assert staged["epoch"] == got["epoch"] and staged["teardown"] == got["teardown"]
    # teardown: the last epoch's requests after its send (durable puts 10, lists 6, misses 3) less the term
    assert got["teardown"] == [{"durable": {"put": 6, "get": 0, "miss": -2, "head": 0, "list": 6, "delete": 0},
                                "store": {"put": 0, "get": 0, "miss": 0, "head": 0, "list": 0, "delete": 0}}]


def test_a_run_without_epochs_or_stores_gives_no_samples():
    assert own_requests.samples({}, snap({}, {}), [(snap({}, {}), {}, "store")], None) == {}
    assert own_requests.samples(ROLES, None, [], None) == {}
    sends = [(snap({DIR: {"put": n}}, {}), {}, "store") for n in (1, 3, 6)]
    assert set(own_requests.samples(ROLES, snap({}, {}), sends[:2], None)) == {"staging"}  # the first epoch's
    three = own_requests.samples(ROLES, snap({}, {}), sends, None)  # no end: no teardown; the second is steady
    assert set(three) == {"staging", "epoch"} and three["epoch"][0]["durable"]["put"] == 3


def test_priced_adds_the_protocol_prices_each_role_by_its_offer_and_never_below_zero():
    offers = {"store": store_offer(S3), "durable": store_offer(DIR)}
    counts = {"store": {"put": 100, "get": -50, "miss": 0, "head": 0, "list": 10, "delete": 0},
              "durable": {"put": 1000}}
    usd = own_requests.priced(counts, {"store": StoreOps(get=20), "elsewhere": StoreOps(put=10 ** 6)}, offers)
    # S3: 110 PUT-class requests; GETs 20 - 50 count as none; the directory is free; no offer, no price
    assert usd == pytest.approx(store_offer(S3).request_usd(StoreOps(put=100, list=10)))


def test_the_run_prediction_adds_staging_before_the_epochs_and_teardown_after():
    from core.kinds import Strategy
    from core.plan import Plan
    from planners.run_prediction import RunTerms, predict_run

    terms = RunTerms(startup_s=2.0, epoch_overhead_s=1.0, gap_s=0.5, provision_s=1.0, teardown_s=1.0)
    plan = Plan(strategy=Strategy.LOCAL_SGD, data_parallel=2, steps_per_epoch=10, price_per_worker_s=1e-5,
                predicted_compute_epoch_s=5.0)
    bare = predict_run(plan, terms, epochs=3, warm=True, workers_launched_s=None)
    own = predict_run(plan, terms, epochs=3, warm=True, workers_launched_s=None, store_usd_before=0.25,
                      store_usd_after=0.5)
    assert own.store_usd == pytest.approx(0.75) and own.cost_usd == pytest.approx(bare.cost_usd + 0.75)
    assert [b - a for a, b in zip(bare.cost_by_epoch_usd, own.cost_by_epoch_usd)] == pytest.approx([0.25] * 3)


@pytest.mark.usefixtures("prefect_api")
def test_the_next_run_on_a_target_predicts_the_requests_the_last_one_made_beyond_its_protocol(tmp_path):
    """A run on a fresh store predicts its protocol's requests alone and measures the rest; the
    next run on that target, another model, carries those counts in its plan's terms, and makes
    the same writes, listings, deletes and existence checks beyond its protocol as predicted
    (what it measured joins the target's samples)."""
    from coordinator.run.job import TrainJob
    from flows.train import train

    url = f"file://{tmp_path}/store"
    job = dict(dataset="digits", workers=2, epochs=3, sync_period=8, strategy="local_sgd", store=url,
               target="inline", warm=False)
    first = train(TrainJob(model="digits_mlp", **job))
    assert not first.plan["run_terms"]["measured"]["own_store_ops"]
    second = train(TrainJob(model="digits_cnn", **job))
    terms = second.plan["run_terms"]
    assert terms["measured"]["own_store_ops"]
    predicted = terms["own_store_ops"]
    assert set(predicted) == {"staging", "epoch", "teardown"} and set(predicted["epoch"]) == {"store"}
    assert predicted["staging"]["store"]["put"] > 0 and predicted["teardown"]["store"]["delete"] > 0
    (timings,) = (tmp_path / "store" / "cache" / "timings").iterdir()
    doc = json.loads(timings.read_text())["value"]
    for part in own_requests.PARTS:
        measured = doc[f"own_{part}_ops"][-1]["store"]  # the second run's own sample
        for kind in ("put", "list", "delete", "head"):
            assert measured[kind] == predicted[part]["store"][kind], (part, kind)


def test_warm_workers_waiting_for_their_command_read_at_the_control_pace():
    """Idle warm workers read their next command's key at the store's pace (S3: 0.1 s) until 2 %
    of their wait exceeds it (5 s), then 2 % of the wait apart: 4 workers waiting 5 s read about
    50 times each; 20 s costs each far fewer than 200."""
    from core.warm_cadence import WarmCadence
    from planners.store_requests import command_wait_ops

    cadence = WarmCadence(60.0, 600.0)
    five = command_wait_ops(4, 5.0, cadence, 0.1)
    assert five.requests == five.miss and 4 * 50 <= five.miss <= 4 * 51
    assert 4 * 100 < command_wait_ops(4, 20.0, cadence, 0.1).miss < 4 * 130
    assert not command_wait_ops(0, 5.0, cadence, 0.1) and not command_wait_ops(4, 0.0, cadence, 0.1)

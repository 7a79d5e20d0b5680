"""The store's part of the bill (issue #45): each store's offer, its requests priced by class,
a cloud Redis's node by the hour, the ledger's store rows and the report's store lines; and a
worker's epoch result carrying the requests its epoch made."""
from __future__ import annotations

import json

import pytest

from comm.store_dir import DirectoryStore
from coordinator.bill.cost import store_lines, store_records, total_usd
from coordinator.report.report import bill_by_kind, cost_curve
from core.cost_record import CostRecord
from core.specs import WorkerResult
from core.store_ops import StoreOps
from planners.catalog import request_price, store_node_price
from planners.store_prices import bill_line, store_offer
from runtime import run_spec as run_spec_module
from runtime.store_report import also_report


def test_each_store_has_its_offer():
    assert store_offer("s3://bucket").name == "s3-standard"
    assert store_offer("az://container").name == "azure-blob-hot"
    assert store_offer("file://").name == store_offer("redis://127.0.0.1:6379").name == "free"
    assert store_offer("redis://localhost:6379").node_per_hour == 0.0
    aws, azure = store_offer("redis://10.0.0.5:6379", "aws"), store_offer("redis://cache.example:6380", "azure")
    assert (aws.name, aws.node_per_hour) == store_node_price("aws") == ("elasticache-cache.t4g.micro", 0.016)
    assert (azure.name, azure.node_per_hour) == store_node_price("azure") == ("azure-cache-redis-basic-c0", 0.022)


def test_s3_prices_put_and_list_apart_from_get_and_head_and_deletes_free():
    ops = StoreOps(put=48_000, list=120, get=90_000, miss=6_000, head=240, delete=5_000, bytes_in=1_900_000_000)
    offer = store_offer("s3://b")
    usd = (48_000 + 120) * 0.005 / 1000 + (90_000 + 6_000 + 240) * 0.0004 / 1000
    assert offer.request_usd(ops) == pytest.approx(usd, rel=1e-12)
    assert {c["name"]: c["requests"] for c in offer.charges(ops)} == {"s3-put": 48_120, "s3-get": 96_240}
    assert bill_line(offer, ops, usd) == ("S3: 48,000 PUT, 90,000 GET, 6,000 missed GET, 240 HEAD, 120 LIST, "
                                          "5,000 DELETE, 1.9 GB in, 0.0 MB out, $0.279")


def test_azure_blob_hot_prices_per_10000_by_class():
    offer = store_offer("az://c")
    ops = StoreOps(put=10_000, get=10_000, list=10_000, head=10_000, delete=10_000)
    assert offer.request_usd(ops) == pytest.approx(0.065 + 0.005 + 0.065 + 0.005, rel=1e-12)
    assert request_price("az-blob-hot-write") * 10_000 == pytest.approx(0.065)


def test_store_rows_in_the_ledger_price_each_party_and_a_cloud_redis_node():
    parties = {"workers": {"s3://b": StoreOps(put=1000, get=2000), "file://": StoreOps(put=5)},
               "coordinator": {"s3://b": StoreOps(put=10, list=2), "redis://10.1.2.3:6379": StoreOps(get=7)}}
    rows = store_records("r1", parties, start=100.0, stop=100.0 + 7200.0, provider="aws")
    by = {r.resource: r for r in rows}
    assert set(by) == {"store file:// workers", "store redis://10.1.2.3:6379 coordinator",
                       "store redis://10.1.2.3:6379 node", "store s3://b coordinator", "store s3://b workers"}
    assert by["store s3://b workers"].usd == pytest.approx(1000 * 5e-6 + 2000 * 4e-7, rel=1e-12)
    assert by["store s3://b coordinator"].usd == pytest.approx(12 * 5e-6, rel=1e-12)
    assert by["store file:// workers"].usd == 0.0 and by["store redis://10.1.2.3:6379 coordinator"].usd == 0.0
    assert by["store redis://10.1.2.3:6379 node"].usd == pytest.approx(2 * 0.016, rel=1e-12)  # two hours
    # cost.json carries them: a row's JSON form reads back (resume) with its counts and dollars
    fields = CostRecord.__dataclass_fields__
    again = [CostRecord(**{k: v for k, v in r.to_dict().items() if k in fields}) for r in rows]
    assert again == rows and total_usd(again) == pytest.approx(total_usd(rows))
    dicts = [r.to_dict() for r in rows]
    assert store_lines(dicts) == [
        "directory: 5 PUT, 0.0 MB in, 0.0 MB out, $0",
        "Redis: 7 GET, 0.0 MB in, 0.0 MB out, $0.0320",
        "S3: 1,010 PUT, 2,000 GET, 2 LIST, 0.0 MB in, 0.0 MB out, $0.00586"]
    # the report's bill: one "store" group, its dollars at the end of the cumulative curve
    assert [g[0] for g in bill_by_kind(dicts)] == ["store"]
    assert bill_by_kind(dicts)[0][1:] == (0.0, pytest.approx(total_usd(rows)))
    assert cost_curve(dicts)[-1][1] == pytest.approx(total_usd(rows))


def test_a_workers_result_carries_its_epochs_store_requests(tmp_path, monkeypatch):
    """`run_spec`: the requests on the run's store since its last report (a warm worker's client
    serves several epochs) and every request on a store the epoch opened, by store."""
    store = DirectoryStore(tmp_path / "run")
    other_url = (tmp_path / "data").as_uri()

    def epoch(spec, run_store, open_ref):
        run_store.put("runs/x/a", b"12")
        data = open_ref(other_url)
        data.put("runs/x/d", b"123")
        assert data.get("runs/x/d") == b"123"
        return WorkerResult(run_id="x", epoch=0, rank=0, started_at=0.0, stopped_at=1.0, train_loss=0.0, samples=0)

    monkeypatch.setattr(run_spec_module, "_run", epoch)
    first = run_spec_module.run_spec(None, store, DirectoryStore.from_url)
    assert first.store_ops == {"file://": StoreOps(put=2, get=1, bytes_in=5, bytes_out=3).to_dict()}
    with pytest.raises(KeyError):
        store.get("runs/x/absent")  # between two epochs: reported with the next one
    second = run_spec_module.run_spec(None, store, DirectoryStore.from_url)
    assert second.store_ops == {"file://": StoreOps(put=2, get=1, miss=1, bytes_in=5, bytes_out=3).to_dict()}
    assert WorkerResult.from_dict(second.to_dict()).store_ops == second.store_ops
    # a client no epoch sees (a warm worker's watch thread) reports with the next epochs, once
    watch = DirectoryStore(tmp_path / "run")
    watch.put("runs/x/status", b"1")
    also_report(watch)
    third = run_spec_module.run_spec(None, store, DirectoryStore.from_url)
    assert third.store_ops == {"file://": StoreOps(put=3, get=1, bytes_in=6, bytes_out=3).to_dict()}
    assert run_spec_module.run_spec(None, store, DirectoryStore.from_url).store_ops == first.store_ops


def test_the_run_prediction_adds_the_stores_requests_and_server():
    """`predict_run`: each epoch's store requests and the store's server over the run, in the
    run's bill and in the bill by each epoch's end."""
    from core.kinds import Strategy
    from core.plan import Plan
    from planners.run_prediction import RunTerms, predict_run, with_run_prediction
    from planners.store_requests import epoch_store_ops

    terms = RunTerms(startup_s=2.0, epoch_overhead_s=1.0, gap_s=0.5, provision_s=1.0, teardown_s=1.0)
    plan = Plan(strategy=Strategy.LOCAL_SGD, data_parallel=4, steps_per_epoch=100, sync_period=1,
                price_per_worker_s=1e-5, predicted_compute_epoch_s=10.0)
    ops = epoch_store_ops(plan)
    per_epoch = store_offer("s3://b").request_usd(ops)
    # every step syncs: 4 ranks x 4 puts and 6 gets a round, 100 rounds, then the release
    assert (ops.put, ops.get) == (4 * 4 * 100 + 4 + 1 + 4 + 100, 4 * 6 * 100 + 3 + 4)
    bare = predict_run(plan, terms, epochs=3, warm=True, workers_launched_s=None)
    with_store = predict_run(plan, terms, epochs=3, warm=True, workers_launched_s=None,
                             store_usd_per_epoch=per_epoch, store_usd_per_s=0.016 / 3600)
    store = 3 * per_epoch + bare.run_s * 0.016 / 3600
    assert with_store.store_usd == pytest.approx(store) and bare.store_usd == 0.0
    assert with_store.cost_usd == pytest.approx(bare.cost_usd + store)
    assert with_store.cost_by_epoch_usd[-1] - bare.cost_by_epoch_usd[-1] == pytest.approx(
        3 * per_epoch + (with_store.run_s - terms.teardown_s) * 0.016 / 3600)
    over_ring = epoch_store_ops(plan, ring=True)
    # checkpoints and history, the ring's rendezvous (an address put, 3 reads), its release and the
    # last round's sync checkpoint
    assert (over_ring.put, over_ring.get) == (1 + 4 + 1 + 4 + 1, 4 + 3 + 3)
    # a checkpoint of 100 MB on S3: a multipart upload of 2 + 7 requests for each of the two written
    big = epoch_store_ops(plan, ring=True, checkpoint_requests=store_offer("s3://b").object_requests(100 * 2 ** 20))
    assert (big.put, big.get) == (over_ring.put + 2 * 8, over_ring.get)
    planned = with_run_prediction(plan, terms, store_ops=ops.to_dict(), epochs=3, warm=True,
                                  workers_launched_s=None, store_usd_per_epoch=per_epoch)
    assert planned.predicted_store_usd == pytest.approx(3 * per_epoch)
    assert planned.predicted_store_ops == ops.to_dict()


@pytest.mark.usefixtures("prefect_api")
def test_the_final_ledger_bills_every_request_the_coordinator_made(tmp_path):
    """The coordinator's store row in the final ledger counts every request its process made in
    the run, the ledger's own put and the summary's and its curves' after it included (their
    requests, not their bytes): the process's counter, read once the flow returned, equals it."""
    from comm.store import open_store
    from comm.store_base import process_ops
    from coordinator.run.job import TrainJob
    from core.keys import ledger_key
    from core.store_ops import StoreOps
    from flows.train import train

    url = f"file://{tmp_path}/store"
    before = process_ops().get("file://", StoreOps())
    summary = train(TrainJob(model="digits_mlp", dataset="digits", workers=1, epochs=1, store=url, target="inline"))
    made = process_ops()["file://"] - before
    store = open_store(url)
    ledger = json.loads(store.get(ledger_key(summary.run_id)))
    billed = StoreOps.from_dict(next(r["store_ops"] for r in ledger["rows"] if r["resource"] == "store file:// coordinator"))
    assert made.put > 0 and made.get > 0
    assert {k: v for k, v in billed.to_dict().items() if not k.startswith("bytes")} == \
        {k: v for k, v in made.to_dict().items() if not k.startswith("bytes")}

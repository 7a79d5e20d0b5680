"""Training from a dataset prepared in a bucket (`dataset=<store URL>`): the coordinator reads the
manifest and the first shards only, nothing is published into the run's store, the workers read
their shards where they are (a directory, the moto server, Azurite), and the losses equal those
of the same job from the factory. A prefix without a manifest, too few shards for `max_workers`,
or a text setting the dataset was not prepared with is refused in one line before anything is
rented; a corrupt shard fails the run naming it."""
from __future__ import annotations

import json

import pytest

from comm.store import open_store
from coordinator.run.job import TrainJob
from coordinator.run.job_fields import check_fields
from coordinator.run.validate import SUBSET_SIZE
from core.errors import ZooidValueError
from core.keys import data_prefix, shard_key
from engine.datasets import prepare_dataset
from flows.train import train
from tests.bucket_stores import bucket_url

pytestmark = pytest.mark.usefixtures("prefect_api")
SOURCE = "synthetic:64:10:256:64"
JOB = dict(model="digits_mlp", workers=2, epochs=2, batch_size=16, lr=0.05, warm=False, max_workers=4)


def prepare_into(url: str, subset_size: int = SUBSET_SIZE):
    store = open_store(url)
    try:
        return prepare_dataset(store, "", SOURCE, subset_size).manifest
    finally:
        store.close()


def losses(summary) -> list[tuple]:
    return [(e.train_loss, e.val_loss) for e in summary.epochs]


@pytest.fixture(scope="module")
def factory_losses(prefect_api, tmp_path_factory) -> list[tuple]:
    """The losses of the job trained from the factory (its subsets staged in the run's store): the
    same for every bucket below, so trained once."""
    factory = train(TrainJob(dataset=SOURCE, store=f"file://{tmp_path_factory.mktemp('factory')}/a", **JOB))
    assert factory.status == "completed"
    return losses(factory)


@pytest.mark.parametrize("where", ["dir", "s3", "azure"])
def test_a_prepared_dataset_trains_in_place_to_the_factory_s_losses(where, tmp_path, request, monkeypatch,
                                                                     factory_losses):
    bucket = bucket_url(where, request, tmp_path, monkeypatch, "data", "syn")
    # the factory's run stages subsets of this many rows (ResolvedJob.subset_size): the same shards
    prepare_into(bucket, min(SUBSET_SIZE, 256 // JOB["max_workers"]))
    prepared = train(TrainJob(dataset=bucket, store=f"file://{tmp_path}/b", data_cache_mb=1.0, **JOB))
    assert prepared.status == "completed"
    assert losses(prepared) == factory_losses and len(factory_losses) == 2
    run_store = open_store(f"file://{tmp_path}/b")
    try:  # nothing was copied into the run's store
        assert run_store.list(data_prefix(prepared.run_id)) == []
    finally:
        run_store.close()


def test_a_corrupt_shard_fails_the_run_naming_it(tmp_path):
    bucket = (tmp_path / "bucket").as_uri()
    prepare_into(bucket)
    store = open_store(bucket)
    key = shard_key("", "train", 1)
    blob = store.get(key)
    store.put(key, blob[:-1] + bytes([blob[-1] ^ 0xFF]))
    store.close()
    state = train(TrainJob(dataset=bucket, store=f"file://{tmp_path}/s", **{**JOB, "epochs": 1}), return_state=True)
    assert state.is_failed()
    assert "shard train/1" in state.message and "corrupt" in state.message and "not retried" in state.message
    run_store = open_store(f"file://{tmp_path}/s")
    try:  # the bytes would be read again the same: one attempt per rank, no relaunch, no task retry
        [ledger] = [json.loads(run_store.get(key)) for key in run_store.list("runs/") if key.endswith("/cost.json")]
    finally:
        run_store.close()
    attempts = sorted((r["rank"], r["attempt"]) for r in ledger["rows"]
                      if r["kind"] in ("worker", "failed_attempt") and r.get("epoch") == 0)
    assert attempts == [(0, 0), (1, 0)]


def test_bad_prepared_datasets_are_refused_naming_the_field_before_anything_runs(tmp_path):
    empty = (tmp_path / "empty").as_uri()
    with pytest.raises(ZooidValueError, match=r"^dataset: no prepared dataset at file://.*empty \(no manifest.json"):
        check_fields({"dataset": empty, **JOB}, api=False)
    few = (tmp_path / "few").as_uri()
    prepare_into(few, subset_size=128)  # 2 training shards
    with pytest.raises(ZooidValueError, match=r"^dataset: .* has 2 training shards, fewer than max_workers=4 .* "
                                              r"subset_size <= 64"):
        check_fields({"dataset": few, **JOB}, api=False)
    text = (tmp_path / "text").as_uri()
    store = open_store(text)
    try:
        prepare_dataset(store, "", "text:stdlib:40", 32)  # bytes, causal, seq_len 128
    finally:
        store.close()
    with pytest.raises(ZooidValueError, match=r"^seq_len: 64, but .* was prepared with seq_len=128"):
        check_fields({"dataset": text, "model": "gpt_mini", "seq_len": 64, **{**JOB, "model": "gpt_mini"}}, api=False)
    job = check_fields({"dataset": text, **{**JOB, "model": "gpt_mini"}}, api=False)  # defaults follow the data
    assert job.dataset == text
    with pytest.raises(ZooidValueError, match=r"^dataset: "):
        check_fields({"dataset": "s3://", **JOB}, api=False)

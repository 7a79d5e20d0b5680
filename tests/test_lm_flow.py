"""A causal language model the registry does not have, given only by import path, through the
train flow: it trains, its summary (summary.json) gives perplexity, tokens per second and
dollars per million tokens, and a run resumed after its first epoch ends equal to an
uninterrupted one (as `test_resume` shows for a classifier)."""
from __future__ import annotations

import json

import pytest
import torch

from coordinator.run.job import TrainJob
from tests import lm_helpers
from tests.test_resume import _weights

pytestmark = pytest.mark.usefixtures("prefect_api")
JOB = dict(model="tests.lm_helpers:tiny_causal_lm", dataset="tests.lm_helpers:token_data", workers=2, batch_size=16,
           optimizer="momentum", lr=0.1, sync_period=4, strategy="local_sgd")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from flows.train import train

    url = (tmp_path_factory.mktemp("lm-flow") / "clean").as_uri()
    return url, train(TrainJob(store=url, epochs=2, **JOB))


@pytest.mark.slow
def test_a_causal_lm_given_by_import_path_trains_and_reports_in_tokens(uninterrupted):
    from comm.store import open_store

    url, summary = uninterrupted
    assert summary.status == "completed" and len(summary.epochs) == 2
    first, last = summary.epochs
    assert last.val_perplexity < first.val_perplexity < lm_helpers.VOCAB
    assert summary.final_perplexity == last.val_perplexity and summary.final_accuracy is None
    # every row's every position is a token trained
    steps = summary.plan["steps_per_epoch"]
    assert first.tokens == 2 * steps * 16 * lm_helpers.SEQ and summary.tokens_trained == 2 * first.tokens
    assert first.tokens_per_s == pytest.approx(first.tokens / first.seconds)
    assert summary.usd_per_million_tokens == pytest.approx(summary.total_cost_usd / summary.tokens_trained * 1e6)
    saved = json.loads(open_store(url).get(f"runs/{summary.run_id}/summary.json"))
    assert saved["usd_per_million_tokens"] == pytest.approx(summary.usd_per_million_tokens)
    assert saved["epochs"][1]["val_perplexity"] == last.val_perplexity


@pytest.mark.slow
def test_a_resumed_lm_run_ends_equal_to_an_uninterrupted_one(tmp_path, uninterrupted):
    from flows.train import train

    clean_url, clean = uninterrupted
    url = (tmp_path / "store").as_uri()
    first = train(TrainJob(store=url, epochs=1, **JOB))
    resumed = train(TrainJob(store=url, epochs=2, resume=first.run_id, **JOB))
    assert resumed.run_id == first.run_id and [e.epoch for e in resumed.epochs] == [0, 1]
    expected = _weights(clean_url, clean.checkpoint_key)
    for k, v in _weights(url, resumed.checkpoint_key).items():
        torch.testing.assert_close(v, expected[k], rtol=1e-5, atol=1e-6)
    assert resumed.final_perplexity == pytest.approx(clean.final_perplexity, rel=1e-4)


@pytest.mark.slow
def test_a_pipelined_lm_counts_each_replicas_tokens_once(tmp_path):
    """Every stage worker reports its replica's rows; the epoch counts the first stages' only."""
    from flows.train import train

    job = {**JOB, "strategy": "hybrid", "workers": 2, "stages": 2, "microbatches": 2, "sync_period": None}
    summary = train(TrainJob(store=(tmp_path / "s").as_uri(), epochs=1, **job))
    assert summary.status == "completed"
    [epoch] = summary.epochs
    assert epoch.stages == 2 and epoch.tokens == epoch.samples * lm_helpers.SEQ > 0
    assert epoch.val_perplexity is not None and summary.usd_per_million_tokens > 0

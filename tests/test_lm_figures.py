"""The figures people use for a language model (issue 42, item 5): tokens per second,
validation perplexity and dollars per million tokens trained, in the per-epoch log line, the
epoch's record, summary.json and the report; a classifier's output stays as it was
(`test_progress`, `test_report`'s golden files)."""
from __future__ import annotations

import json

import pytest

from coordinator.report.progress import epoch_line
from coordinator.report.report import epoch_table, markdown_report, text_report
from coordinator.run.job import RunSummary
from core.epoch_summary import EpochSummary, run_token_figures
from core.specs import WorkerResult


def token_epoch(epoch: int, **fields) -> EpochSummary:
    base = dict(epoch=epoch, workers=2, train_loss=2.5, val_loss=2.0, val_perplexity=7.389, val_token_accuracy=0.4123,
                samples=512, tokens=65536, seconds=4.0, samples_per_s=128.0, tokens_per_s=16384.0, cost_usd=0.002)
    return EpochSummary(**{**base, **fields})


def test_the_epoch_line_of_a_language_model_gives_perplexity_token_accuracy_and_tokens_per_second():
    line = epoch_line(token_epoch(0), 3, 0.002, None)
    assert line == ("epoch 1/3: 2 worker(s), loss 2, perplexity 7.389, token accuracy 41.2%, 16,384 tokens/s, "
                    "4.00 s, cost so far $0.00200")


def test_a_run_in_tokens_sums_its_epochs_and_prices_a_million_tokens():
    epochs = [token_epoch(0), token_epoch(1, tokens=65536, seconds=4.0)]
    figures = run_token_figures(epochs, cost_usd=0.00655)
    assert figures == {"tokens_trained": 131072, "tokens_per_s": 131072 / 8.0,
                       "usd_per_million_tokens": pytest.approx(0.00655 / 0.131072)}
    assert run_token_figures([EpochSummary(epoch=0, workers=1, train_loss=1.0, seconds=1.0)], 1.0) == {}


def summary() -> RunSummary:
    epochs = [token_epoch(0), token_epoch(1, val_loss=1.5, val_perplexity=4.4817, val_token_accuracy=0.55)]
    return RunSummary(run_id="run-lm-01", status="completed", final_loss=1.5, final_perplexity=4.4817,
                      final_token_accuracy=0.55, total_cost_usd=0.00655, epochs=epochs,
                      plan={"strategy": "local_sgd", "data_parallel": 2, "stages": 1},
                      **run_token_figures(epochs, 0.00655))


def test_the_report_of_a_language_model_leads_with_perplexity_and_the_price_of_a_million_tokens():
    text = text_report(summary())
    lines = text.splitlines()
    assert lines[1] == "completed: final perplexity 4.482 (loss 1.500, token accuracy 55.0%) after 2 epochs"
    assert "131,072 tokens trained at 16400 tokens/s; $0.0500 per million tokens" in lines[3]
    header = next(line for line in lines if line.startswith("epoch "))
    assert "perplexity" in header and "token accuracy" in header and "tokens/s" in header
    assert " accuracy " not in header.replace("token accuracy", "") and "samples/s" not in header
    md = markdown_report(summary(), [], None)
    assert "**completed: final perplexity 4.482" in md and "$0.0500 per million tokens." in md
    assert epoch_table(summary().epochs)[1]["val perplexity"] == "4.482"


def test_summary_json_carries_the_token_figures_and_a_classifiers_has_none():
    back = json.loads(summary().model_dump_json())
    assert (back["tokens_trained"], back["final_perplexity"]) == (131072, 4.4817)
    assert back["usd_per_million_tokens"] == pytest.approx(0.05, rel=1e-3)
    assert back["epochs"][1]["tokens_per_s"] == 16384.0 and back["epochs"][1]["val_token_accuracy"] == 0.55
    plain = json.loads(RunSummary(run_id="r", status="completed", final_accuracy=0.9).model_dump_json())
    assert plain["tokens_trained"] == 0 and plain["final_perplexity"] is None


def test_a_workers_token_figures_survive_its_json_result():
    r = WorkerResult(run_id="r", epoch=0, rank=0, started_at=0.0, stopped_at=1.0, train_loss=2.0, samples=4,
                     tokens=512, val_loss=1.0, val_perplexity=2.718, val_token_accuracy=0.5)
    assert WorkerResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r

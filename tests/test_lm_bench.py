"""The language-model benchmark's parts a and b (benchmarks/lm_sync.py, benchmarks/lm_plain.py):
the results file keeps each part's last section, part a's target rule, and part b's two sides
training the same numbers; and the validation chunk a token model is scored in."""
from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks.harness.tables import merged_body, sections
from benchmarks.lm_sync import KAVG, configs, reached
from engine.local_sgd import VALIDATION_ROWS, VALIDATION_TOKENS, validation_chunk, validation_metrics
from engine.objective import CROSS_ENTROPY


def test_a_run_keeps_the_other_parts_sections(tmp_path):
    path = tmp_path / "lm.md"
    path.write_text("# Title\n\nCommand: `x`\n\n## b. Old b\n\nold b body\n\n## c. Planned\n\n### T = 128\n\nc body\n")
    body = merged_body(path, {"a": "## a. Sync\n\na body\n", "b": "## b. New b\n\nnew b body"})
    assert list(sections(body)) == ["a", "b", "c"]
    assert sections(body)["c"] == "## c. Planned\n\n### T = 128\n\nc body"
    assert "old b body" not in body and "new b body" in body
    assert merged_body(tmp_path / "none.md", {"b": "## b. B"}) == "## b. B"


def test_part_a_target_rule_and_order():
    args = argparse.Namespace(sync_k=8, diloco_k=32, sync_stores=["directory"])
    rows = configs(args)
    assert rows[0].name.startswith(KAVG)  # its run fixes the target before any DiLoCo row exists
    assert [(c.period, c.outer, c.dtype) for c in rows] == [
        (8, "average", "float32"), (1, "average", "float32"), (32, "nesterov", "float32"), (32, "nesterov", "int8"),
        (8, "nesterov", "float32"), (8, "nesterov", "int8")]  # DiLoCo at its own period, then at K-AVG's
    assert len(configs(argparse.Namespace(sync_k=8, diloco_k=8, sync_stores=["directory"]))) == 4  # one period: its DiLoCo rows once
    assert reached([9.0, 7.5, 7.0, 6.9], 7.0) == 3
    assert reached([9.0, 8.0], 7.0) is None


def test_validation_chunk_bounds_token_positions():
    assert validation_chunk(torch.zeros(5000, 128, dtype=torch.int64)) == VALIDATION_TOKENS // 128
    assert validation_chunk(torch.zeros(10, 4 * VALIDATION_TOKENS, dtype=torch.int64)) == 1
    assert validation_chunk(torch.zeros(10, 3, 32, 32)) == VALIDATION_ROWS
    assert validation_chunk(torch.zeros(5000, 2, dtype=torch.int64)) == VALIDATION_ROWS


def test_token_validation_in_chunks_scores_like_one_pass():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)).double()
    x = torch.randint(0, 11, (300, 64))
    y = torch.randint(0, 11, (300, 64))
    chunked = validation_metrics(model, x, y, CROSS_ENTROPY)  # 256 rows, then 44
    whole = validation_metrics(model, x, y, CROSS_ENTROPY, chunk=300)
    assert chunked.loss == pytest.approx(whole.loss, rel=1e-12)
    assert chunked.token_accuracy == whole.token_accuracy


def test_part_b_sides_train_the_same_numbers():
    from benchmarks.lm_plain import run_plain_vs_zooid

    zooid, plain, facts = run_plain_vs_zooid("gpt_mini", "cpu", batch=16, seq_len=32, kb=2, epochs=2, lr=1e-3)
    # an epoch is one pass: every training block once, the last batch shorter
    assert facts["steps"] == -(-facts["n_train"] // 16) and facts["tokens_per_epoch"] == facts["n_train"] * 32
    assert len(zooid.seconds) == len(plain.seconds) == 2
    assert zooid.perplexity == pytest.approx(plain.perplexity, rel=1e-5)
    assert zooid.perplexity[1] < zooid.perplexity[0]


def test_a_lone_replica_writes_one_checkpoint_and_its_relaunch_resumes_from_it(tmp_path):
    """World 1: no sync checkpoint at the last round (the epoch checkpoint stands in for it);
    a relaunch after the epoch checkpoint trains nothing and ends on the same weights."""
    from comm.store_dir import DirectoryStore
    from core.keys import sync_checkpoint_key
    from core.specs import WorkerSpec
    from engine.checkpoint import initial_checkpoint, load_checkpoint
    from engine.datasets import publish_dataset
    from engine.local_sgd_epoch import run_local_sgd_epoch
    from engine.models import build_model

    store = DirectoryStore(tmp_path)
    publish_dataset(store, "lone", "synthetic:64:10:64:16", subset_size=32)  # an epoch: 4 steps of 16
    initial_checkpoint(store, "runs/lone/ckpt/init", "digits_mlp", "adam", lr=0.01)
    spec = WorkerSpec(run_id="lone", epoch=0, rank=0, world=1, store_url=store.url, model="digits_mlp",
                      dataset="synthetic:64:10:64:16", steps=4, batch_size=16, lr=0.01, optimizer="adam",
                      init_key="runs/lone/ckpt/init", out_key="runs/lone/ckpt/e0")
    first = run_local_sgd_epoch(spec, store)
    assert first.samples == 64
    assert store.list(sync_checkpoint_key("lone", 0)) == []
    before = build_model("digits_mlp")
    load_checkpoint(store, "runs/lone/ckpt/e0", before)
    again = run_local_sgd_epoch(WorkerSpec.from_dict({**spec.to_dict(), "attempt": 1}), store)
    assert again.samples == 0 and again.checkpoint_key == "runs/lone/ckpt/e0"
    after = build_model("digits_mlp")
    meta = load_checkpoint(store, "runs/lone/ckpt/e0", after)
    assert meta["global_step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


def _fake_run(perplexity, mb_per_epoch, s_per_epoch=3.5):
    from types import SimpleNamespace
    n = len(perplexity)
    return SimpleNamespace(perplexity=perplexity, seconds=[s_per_epoch + 1.0] + [s_per_epoch] * (n - 1),
                           startup_s=[1.0] + [0.0] * (n - 1), bytes_synced=[mb_per_epoch * 1e6] * n,
                           compute_s=[3.0] * n, sync_s=[0.3] * n, ok=True, status="COMPLETED / completed", run_id="z0")


def test_part_a_judges_each_seed_against_its_own_target_on_the_medians():
    from benchmarks.lm_sync import render_sync

    args = argparse.Namespace(sync_k=8, diloco_k=32, sync_kb=200, sync_seq_len=64, sync_epochs=5, sync_lr=0.05,
                              sync_seeds=[0, 1, 2], sync_stores=["directory"])
    kavg = [_fake_run([16, 14, 13, 11.5, 10.7], 86), _fake_run([17, 14, 12, 11.9, 10.5], 86),
            _fake_run([16, 15, 12, 11.2, 10.3], 86)]
    # DiLoCo k=32: its own seed's target (11.5, 11.9, 11.2) in 4, 5 and 4 epochs; cheaper epochs
    k32 = [_fake_run([16, 14, 13, 11.4, 10.7], 20, 3.4), _fake_run([17, 14, 12, 12.0, 11.0], 20, 3.4),
           _fake_run([16, 15, 12, 11.1, 10.3], 20, 3.4)]
    runs = [(c, kavg if c.outer == "average" else k32) for c in configs(args)]
    text = render_sync(runs, args, "cmd")
    assert "**11.5000** (seed 0), **11.9000** (seed 1), **11.2000** (seed 2)" in text
    line = next(x for x in text.splitlines() if x.startswith("- DiLoCo k=32:"))
    # medians: 4 epochs (4, 5, 4), 13.6 s against 14.0, 80 MB against 344: met though one round took 5
    assert line.startswith("- DiLoCo k=32: **met**: 80.00 MB in 13.6 s over 4 epochs against K-AVG's 344.00 MB in 14.0 s")
    assert "reached in K-AVG's epochs or fewer in 2 of 3 rounds" in line
    k32[2] = _fake_run([16, 15, 12, 11.3, 11.25], 20, 3.4)  # never reached: 4, 5, infinite
    text = render_sync([(c, kavg if c.outer == "average" else k32) for c in configs(args)], args, "cmd")
    line = next(x for x in text.splitlines() if x.startswith("- DiLoCo k=32:"))
    assert line.startswith("- DiLoCo k=32: **not met**: 100.00 MB in 17.0 s over 5 epochs") and "not reached" in line
    k32[1] = _fake_run([17, 14, 12, 12.0, 11.95], 20, 3.4)  # most rounds never reach it
    text = render_sync([(c, kavg if c.outer == "average" else k32) for c in configs(args)], args, "cmd")
    assert "- DiLoCo k=32: **not met** (the target not reached in most rounds)." in text


def test_part_a_over_s3_runs_the_rows_that_can_meet_the_bytes_and_judges_them_on_their_store():
    from benchmarks.lm_sync import render_sync, run_order, sync_params

    args = argparse.Namespace(sync_k=8, diloco_k=32, sync_kb=200, sync_seq_len=64, sync_epochs=5, sync_lr=0.05,
                              sync_seeds=[0, 1, 2], sync_stores=["directory", "S3"])
    rows = configs(args)
    assert [c.name for c in rows if c.store == "S3"] == [
        "K-AVG k=8 over S3", "DiLoCo k=32 over S3", "DiLoCo k=32 int8 over S3", "DiLoCo k=8 int8 over S3"]
    # each store's K-AVG runs next to DiLoCo at its period
    assert [c.name for c in run_order(args)][:5] == ["K-AVG k=8", "DiLoCo k=8", "DiLoCo k=8 int8",
                                                     "K-AVG k=8 over S3", "DiLoCo k=8 int8 over S3"]
    stores = {"S3": {"store": "s3://b/runs?endpoint=http://127.0.0.1:1", "durable_store": "file:///tmp/st"}}
    on_s3 = sync_params(args, rows[-1], 3, stores)
    assert on_s3["store"].startswith("s3://b/") and on_s3["durable_store"] == "file:///tmp/st"
    assert on_s3["seed"] == 3 and on_s3["sync_dtype"] == "int8" and on_s3["sync_period"] == 8
    assert "store" not in sync_params(args, rows[0], 3, stores)  # the directory rows: the stack's own store

    kavg = [_fake_run([16, 14, 13, 11.5, 10.7], 86), _fake_run([17, 14, 12, 11.9, 10.5], 86),
            _fake_run([16, 15, 12, 11.2, 10.3], 86)]
    kavg_s3 = [_fake_run(r.perplexity, 86, 4.5) for r in kavg]  # same perplexities, slower epochs over HTTP
    int8 = [_fake_run(r.perplexity, 21, 3.6) for r in kavg]  # a quarter of the bytes, each epoch 0.1 s slower
    int8_s3 = [_fake_run(r.perplexity, 21, 4.2) for r in kavg]  # ... and 0.3 s faster over S3

    def runs_of(c):
        if c.is_kavg:
            return kavg_s3 if c.store == "S3" else kavg
        return (int8_s3 if c.store == "S3" else int8) if c.dtype == "int8" else kavg

    text = render_sync([(c, runs_of(c)) for c in rows], args, "cmd")
    assert "**11.5000** (seed 0), **11.9000** (seed 1), **11.2000** (seed 2) (the same from K-AVG's runs" in text
    directory = next(x for x in text.splitlines() if x.startswith("- DiLoCo k=8 int8:"))
    s3 = next(x for x in text.splitlines() if x.startswith("- DiLoCo k=8 int8 over S3:"))
    assert directory.startswith("- DiLoCo k=8 int8: **not met**: 84.00 MB in 14.4 s over 4 epochs against K-AVG's "
                                "344.00 MB in 14.0 s")  # against the directory K-AVG
    assert s3.startswith("- DiLoCo k=8 int8 over S3: **met**: 84.00 MB in 16.8 s over 4 epochs against K-AVG's "
                         "344.00 MB in 18.0 s")  # against K-AVG over S3, not the directory's 14.5 s
    assert text.count("Each round: its seed and target") == 2  # one table a store

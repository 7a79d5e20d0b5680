"""Language models and custom losses through every strategy, in float64 (as the CNN tests in
`test_pipeline_equivalence` and `test_pipeline_interleaved` do).

The registry's `gpt_mini` (shrunk by its arguments) and a causal transformer the registry does
not have (`tests.lm_helpers:tiny_causal_lm`, given only by import path), on token windows whose targets are partly -100 (rows score different numbers
of positions, so a micro-batch's share of the loss is its share of scored positions, not of
rows): a pipeline is single-process training, a hybrid is Local-SGD averaging every step,
gpipe, 1f1b and interleaved train the same weights, a replica relaunched from the sync
checkpoint ends equal to the uninterrupted run, and the model learns its sequence. A custom
loss (`tests.lm_helpers:mse`) trains a regression, alone and as a pipeline.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from comm.store import open_store
from core.specs import ComputeSpec, SyncSpec, WorkerSpec
from engine.checkpoint import initial_checkpoint, load_checkpoint
from engine.datasets import publish_dataset, read_subsets
from engine.epoch_order import epoch_steps
from engine.local_sgd import validation_metrics
from engine.local_sgd_epoch import read_epoch_history, run_local_sgd_epoch
from engine.models import build_model
from engine.objective import objective_for
from engine.pipeline_executor import pipeline_worker_specs, run_pipeline_worker
from tests import lm_helpers
from tests.forked_workers import start_worker
from tests.test_pipeline_equivalence import assert_same_weights, run_threads, weights

RUN = "lm"
LM = "tests.lm_helpers:tiny_causal_lm"
GPT_KWARGS = {"vocab_size": lm_helpers.VOCAB, "max_positions": lm_helpers.SEQ, "d_model": 16, "heads": 2}
"""`gpt_mini` at the size of the test's vocabulary and windows."""
MODELS = {"gpt_mini": GPT_KWARGS, LM: {}}
MASKED = "tests.lm_helpers:masked_token_data"
STEPS, BATCH, LR = 6, 32, 0.3
N = 384
"""Training windows of `lm_helpers.token_data`: STEPS steps for 2 replicas of BATCH, twice as many for one."""
REPO = Path(__file__).resolve().parents[1]
CHILDREN = 5
"""tiny_causal_lm's top-level children: embeddings, two blocks, final norm, head."""


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A directory store with the masked token windows published and seeded initial checkpoints."""
    url = (tmp_path_factory.mktemp("lm") / "store").as_uri()
    store = open_store(url)
    manifest = publish_dataset(store, RUN, MASKED, subset_size=32)
    for model, kwargs in MODELS.items():
        for optimizer in ("sgd", "momentum"):
            initial_checkpoint(store, f"runs/{RUN}/init-{optimizer}-{model}", model, optimizer, LR, seed=4,
                               model_kwargs=kwargs)
    return url, manifest


def spec(url: str, world: int, out: str, model: str = LM, optimizer: str = "sgd", **fields) -> WorkerSpec:
    """`world` replicas' spec (a pipeline's: its D), a fresh epoch's steps."""
    base = WorkerSpec(run_id=RUN, epoch=0, rank=0, world=world, store_url=url, model=model, dataset=MASKED,
                      steps=epoch_steps(N, world, BATCH), batch_size=BATCH, lr=LR, optimizer=optimizer,
                      sync_period=1, seed=4, init_key=f"runs/{RUN}/init-{optimizer}-{model}", out_key=f"{out}-{model}",
                      sync_timeout_s=60.0, compute=ComputeSpec(dtype="float64", model_kwargs=MODELS.get(model, {})))
    return dataclasses.replace(base, **fields)


@pytest.mark.parametrize("model", MODELS)
def test_a_pipeline_of_a_causal_lm_equals_single_process_training(staged, model):
    url, manifest = staged
    [ref] = run_threads([spec(url, 1, f"runs/{RUN}/single", model)], run_local_sgd_epoch)
    specs = pipeline_worker_specs(spec(url, 1, f"runs/{RUN}/pipe", model), cuts=[2, 4], microbatches=4)
    results = run_threads(specs, run_pipeline_worker)
    assert_same_weights(weights(url, f"runs/{RUN}/pipe-{model}"), weights(url, f"runs/{RUN}/single-{model}"))
    last = results[-1]
    # Local-SGD sums its losses in a float32 accumulator, hence the looser tolerance here.
    assert last.train_loss == pytest.approx(ref.train_loss, rel=1e-6)
    assert last.val_loss == pytest.approx(ref.val_loss, rel=1e-9)
    assert last.val_perplexity == pytest.approx(math.exp(ref.val_loss), rel=1e-9)
    assert last.val_token_accuracy == ref.val_token_accuracy and 0 <= ref.val_token_accuracy <= 1
    assert ref.val_accuracy is None and last.val_accuracy is None  # token targets: no class accuracy
    # tokens trained: every position of every row read, the ignored ones included
    assert ref.tokens == results[0].tokens == N * lm_helpers.SEQ


@pytest.mark.parametrize("model", MODELS)
def test_a_hybrid_of_a_causal_lm_equals_local_sgd_averaging_every_step(staged, model):
    url, manifest = staged
    local = [spec(url, 2, f"runs/{RUN}/lsgd", model, rank=r) for r in range(2)]
    refs = run_threads(local, run_local_sgd_epoch)
    specs = pipeline_worker_specs(spec(url, 2, f"runs/{RUN}/hybrid", model, sync=SyncSpec(bucket_mb=4000 / 2**20)),
                                  cuts=[3], microbatches=2, replicas=2)
    results = run_threads(specs, run_pipeline_worker)
    assert_same_weights(weights(url, f"runs/{RUN}/hybrid-{model}"), weights(url, f"runs/{RUN}/lsgd-{model}"))
    for r in range(2):
        assert results[2 * r + 1].train_loss == pytest.approx(refs[r].train_loss, rel=1e-6)
    assert results[1].val_perplexity == pytest.approx(refs[0].val_perplexity, rel=1e-9)


@pytest.mark.parametrize("model", MODELS)
def test_gpipe_1f1b_and_interleaved_agree_on_a_causal_lm(staged, model):
    url, manifest = staged
    cuts = [1, 2, 3]  # four model stages: embeddings | block | block | norm + head
    trained = {}
    for schedule in ("gpipe", "1f1b", "interleaved"):
        out = f"runs/{RUN}/sched-{schedule}"
        specs = pipeline_worker_specs(spec(url, 1, out, model, optimizer="momentum"),
                                      cuts=cuts, microbatches=4,
                                      schedule=schedule, chunks=2 if schedule == "interleaved" else 1)
        assert len(specs) == (2 if schedule == "interleaved" else 4)
        results = run_threads(specs, run_pipeline_worker)
        trained[schedule] = (weights(url, f"{out}-{model}"), results[-1])
    for schedule in ("1f1b", "interleaved"):
        assert_same_weights(trained[schedule][0], trained["gpipe"][0])
        assert trained[schedule][1].val_perplexity == pytest.approx(trained["gpipe"][1].val_perplexity, rel=1e-9)


def test_a_causal_lm_given_only_by_import_path_learns_its_sequence(tmp_path):
    """Two replicas, Adam, the unmasked windows: validation perplexity falls from about the
    vocabulary's size to near 1 and most next tokens are predicted."""
    url = (tmp_path / "store").as_uri()
    store = open_store(url)
    publish_dataset(store, "learn", "tests.lm_helpers:token_data", subset_size=32)
    initial_checkpoint(store, "runs/learn/e-1", LM, "adam", 0.01, seed=0)
    perplexities, accuracies = [], []
    for epoch in range(4):
        specs = [WorkerSpec(run_id="learn", epoch=epoch, rank=r, world=2, store_url=url, model=LM,
                            dataset="tests.lm_helpers:token_data", steps=12,
                            batch_size=16, lr=0.01, optimizer="adam", sync_period=4, seed=0,
                            init_key=f"runs/learn/e{epoch - 1}", out_key=f"runs/learn/e{epoch}")
                 for r in range(2)]
        [rank0, _] = run_threads(specs, run_local_sgd_epoch)
        perplexities.append(rank0.val_perplexity)
        accuracies.append(rank0.val_token_accuracy)
        assert rank0.tokens == 12 * 16 * lm_helpers.SEQ
    assert perplexities[0] < lm_helpers.VOCAB and perplexities[-1] < 2.0 < perplexities[0]
    assert accuracies[-1] > 0.8


def test_a_causal_lm_replica_relaunched_from_the_sync_checkpoint_ends_equal(tmp_path):
    """Resume: rank 1 is killed right after the sync at step 3 (a process, as a worker runs); its
    relaunch (`attempt=1`) resumes from the sync checkpoint (weights and momentum) and the epoch
    ends on the uninterrupted run's weights."""
    url = (tmp_path / "store").as_uri()
    store = open_store(url)
    publish_dataset(store, RUN, MASKED, subset_size=32)
    initial_checkpoint(store, f"runs/{RUN}/init", LM, "momentum", LR, seed=4)

    def specs(out: str) -> list[WorkerSpec]:
        return [spec(url, 2, out, rank=r, optimizer="momentum", init_key=f"runs/{RUN}/init",
                     sync_period=3, evaluate=False, out_key=out) for r in range(2)]

    run_threads(specs(f"runs/{RUN}/clean"), run_local_sgd_epoch)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "ZOOID_CHAOS": "kill_worker:epoch=0:rank=1:step=3:at=sync"}

    def launch(s: WorkerSpec):
        return start_worker(s, env, tmp_path / f"r{s.rank}-a{s.attempt}.log")

    def output(s: WorkerSpec) -> str:
        return (tmp_path / f"r{s.rank}-a{s.attempt}.log").read_text()[-2000:]

    killed = specs(f"runs/{RUN}/killed")
    first = [launch(s) for s in killed]
    try:
        assert first[1].wait(timeout=120) != 0  # killed at its first sync
        relaunch = launch(dataclasses.replace(killed[1], attempt=1))
        assert relaunch.wait(timeout=120) == 0, output(dataclasses.replace(killed[1], attempt=1))
        assert first[0].wait(timeout=120) == 0, output(killed[0])
    finally:
        for p in first:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    history = read_epoch_history(store, RUN, 0)
    again = next(h for h in history if (h["rank"], h["attempt"]) == (1, 1))
    assert again["from_sync_checkpoint"] and again["start_step"] == 3
    clean, killed = weights(url, f"runs/{RUN}/clean"), weights(url, f"runs/{RUN}/killed")
    for k in clean:
        torch.testing.assert_close(killed[k], clean[k], rtol=1e-12, atol=1e-12)


def test_a_custom_loss_trains_a_regression_alone_and_as_a_pipeline(tmp_path):
    url = (tmp_path / "store").as_uri()
    store = open_store(url)
    data, model, loss = "tests.lm_helpers:regression_data", "tests.lm_helpers:tiny_regressor", "tests.lm_helpers:mse"
    manifest = publish_dataset(store, "reg", data, subset_size=32)
    assert manifest.classes == 0
    initial_checkpoint(store, "runs/reg/init", model, "momentum", 0.05, seed=1)
    base = WorkerSpec(run_id="reg", epoch=0, rank=0, world=1, store_url=url, model=model, dataset=data,
                      steps=48, batch_size=8, lr=0.05,
                      optimizer="momentum", sync_period=1, seed=1, init_key="runs/reg/init", out_key="runs/reg/single",
                      compute=ComputeSpec(dtype="float64"), loss=loss)
    untrained = build_model(model, 1).double()
    load_checkpoint(store, "runs/reg/init", untrained)
    vx, vy = read_subsets(store, "reg", range(manifest.n_val_subsets), split="val")
    before = validation_metrics(untrained, vx.double(), vy.double(), objective_for(loss))
    [single] = run_threads([base], run_local_sgd_epoch)
    assert single.val_loss < before.loss / 5
    assert single.val_accuracy is single.val_perplexity is None and single.tokens == 0
    specs = pipeline_worker_specs(dataclasses.replace(base, out_key="runs/reg/pipe"), cuts=[2], microbatches=4)
    results = run_threads(specs, run_pipeline_worker)
    assert_same_weights(weights(url, "runs/reg/pipe"), weights(url, "runs/reg/single"))
    assert results[-1].val_loss == pytest.approx(single.val_loss, rel=1e-9)
    assert WorkerSpec.from_dict(base.to_dict()).loss == loss

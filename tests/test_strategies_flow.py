"""Pipeline and hybrid through the whole flow: the mathematics holds end to end.

Plain SGD, a fixed seed, `digits_mlp` (no dropout, no BatchNorm): one replica as a 2-stage x
4-micro-batch pipeline ends where single-process Local-SGD ends; hybrid 2 x 2 ends the same
whether its stages average gradients through the store or over a direct ring (the ring's use
shown by the bytes its workers moved)."""
from __future__ import annotations

import pytest

from comm.ring_allreduce import ring_bytes
from coordinator.run.job import TrainJob
from engine.models import build_model

pytestmark = pytest.mark.usefixtures("prefect_api")
BASE = dict(epochs=1, optimizer="sgd", lr=0.1, batch_size=16, prestart=False)


def _run(tmp_path, name: str, **kw):
    from flows.train import train

    return train(TrainJob(store=f"file://{tmp_path}/{name}", **BASE, **kw))


@pytest.mark.slow
def test_pipeline_equals_one_process(tmp_path):
    pipe = _run(tmp_path, "pipe", strategy="pipeline", stages=2, microbatches=4)
    single = _run(tmp_path, "single", strategy="local_sgd", workers=1, min_workers=1)
    assert (pipe.plan["strategy"], pipe.plan["stages"]) == ("pipeline", 2)
    assert pipe.final_loss == pytest.approx(single.final_loss, rel=5e-4)
    assert abs(pipe.final_accuracy - single.final_accuracy) <= 1 / 360 + 1e-12


@pytest.mark.slow
def test_hybrid_over_a_ring_equals_hybrid_through_the_store(tmp_path):
    store = _run(tmp_path, "store", strategy="hybrid", workers=2, stages=2, microbatches=4)
    ring = _run(tmp_path, "ring", strategy="hybrid", workers=2, stages=2, microbatches=4, collective="ring")
    assert (ring.plan["data_parallel"], ring.plan["stages"]) == (2, 2)
    # The ring was used: the ring run's workers moved exactly the raw float32 gradients a ring
    # moves, each replica of each stage sending and receiving ring_bytes(its bytes, 2) a step
    # (linear in the bytes at 2 ranks, so the stages sum to the model's); through the store
    # the same gradients travel encoded, headers and all, so more bytes.
    model_bytes = sum(p.numel() * 4 for p in build_model("digits_mlp", 0).parameters())
    ring_moved = ring.plan["steps_per_epoch"] * ring.plan["data_parallel"] * 2 * ring_bytes(model_bytes, 2)
    assert [e.bytes_synced for e in ring.epochs] == [ring_moved]
    assert [e.bytes_synced > ring_moved for e in store.epochs] == [True]
    assert ring.final_loss == pytest.approx(store.final_loss, rel=5e-4)
    assert abs(ring.final_accuracy - store.final_accuracy) <= 1 / 360 + 1e-12

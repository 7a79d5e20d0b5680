"""Pipeline and hybrid training equal single-process and Local-SGD training, in float64.

Plain SGD, one seeded `digits_mlp`, Local-SGD's data order (the epoch's, `engine.replica_data`;
390 rows, so the last step's batches are short), losses as means over the iteration's batch: a 2-stage x 4-micro-batch pipeline is single-process
training, and hybrid 2 x 2 is Local-SGD with 2 replicas averaging every step. Stage workers
run as threads, each with its own client of one directory store.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from comm.store import open_store
from comm.tensor_codec import decode_tensors
from core.errors import StoreTimeout, ZooidValueError
from core.keys import activation_prefix
from core.specs import ComputeSpec, StageSpec, SyncSpec, WorkerSpec
from engine.checkpoint import initial_checkpoint
from engine.datasets import publish_dataset
from engine.epoch_order import epoch_steps
from engine.local_sgd_epoch import run_local_sgd_epoch
from engine.pipeline_executor import iteration_schedule, pipeline_worker_specs, run_pipeline_worker

RUN = "eq"
DATA, N, BATCH, LR = "synthetic:64:10:390:64", 390, 32, 0.2


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A directory store with digits published and a seeded initial checkpoint."""
    url = (tmp_path_factory.mktemp("pipe") / "store").as_uri()
    store = open_store(url)
    manifest = publish_dataset(store, RUN, DATA, subset_size=64)
    initial_checkpoint(store, f"runs/{RUN}/init", "digits_mlp", "sgd", LR, seed=3)
    return url, manifest


def base_spec(url: str, world: int, out: str) -> WorkerSpec:
    """`world` replicas' spec (a pipeline's: its D), a fresh epoch's steps."""
    return WorkerSpec(run_id=RUN, epoch=0, rank=0, world=world, store_url=url,
                      model="digits_mlp", dataset=DATA,
                      steps=epoch_steps(N, world, BATCH), batch_size=BATCH, lr=LR, optimizer="sgd", sync_period=1,
                      seed=3, init_key=f"runs/{RUN}/init", out_key=out, sync_timeout_s=30.0,
                      compute=ComputeSpec(dtype="float64"))


def run_threads(specs, runner):
    """Run `runner(spec, own store client)` for every spec on its own thread."""
    results, errors = [None] * len(specs), []

    def body(i):
        store = open_store(specs[i].store_url)
        try:
            results[i] = runner(specs[i], store)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
        finally:
            store.close()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def weights(url: str, key: str) -> dict[str, torch.Tensor]:
    tensors, _ = decode_tensors(open_store(url).get(key))
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].dtype == torch.float64
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-12)


def test_two_stage_four_microbatch_pipeline_equals_single_process(staged):
    url, manifest = staged
    single = base_spec(url, 1, f"runs/{RUN}/single")
    [ref] = run_threads([single], run_local_sgd_epoch)

    specs = pipeline_worker_specs(base_spec(url, 1, f"runs/{RUN}/pipe"),
                                  cuts=[2], microbatches=4, replicas=1)
    results = run_threads(specs, run_pipeline_worker)

    assert_same_weights(weights(url, f"runs/{RUN}/pipe"), weights(url, f"runs/{RUN}/single"))
    last = results[-1]
    assert last.checkpoint_key == f"runs/{RUN}/pipe"
    # Local-SGD sums its losses in a float32 accumulator, hence the looser tolerance here.
    assert last.train_loss == pytest.approx(ref.train_loss, rel=1e-6)
    assert results[0].train_loss == last.train_loss  # shared from the last stage
    assert last.val_loss == pytest.approx(ref.val_loss, rel=1e-9)
    assert last.val_accuracy == ref.val_accuracy
    store = open_store(url)
    assert store.list(activation_prefix(RUN, 0)) == []
    # each stage times its steady-state period, which the flow records beside the prediction
    assert all(0 < r.iteration_s < r.stopped_at - r.started_at for r in results)


def test_hybrid_two_by_two_equals_local_sgd_averaging_every_step(staged):
    """Against Local-SGD averaging parameters after every step (the old every-step sync), the
    hybrid's stages average gradients in buckets (1000 bytes: several per stage) started during
    their last backward, through either store collective and over the ring."""
    url, manifest = staged
    local = [dataclasses.replace(base_spec(url, 2, f"runs/{RUN}/lsgd"), rank=r,
                                 sync=SyncSpec(every_step="parameters"))
             for r in range(2)]
    refs = run_threads(local, run_local_sgd_epoch)

    for sync in ("pipelined", "plain", "ring"):
        out = f"runs/{RUN}/hybrid-{sync}"
        base = dataclasses.replace(base_spec(url, 2, out), sync=SyncSpec(collective=sync, bucket_mb=1000 / 2**20))
        specs = pipeline_worker_specs(base, cuts=[1], microbatches=2, replicas=2)
        assert [(s.stage.replica, s.stage.index, s.rank, s.world) for s in specs] == [
            (0, 0, 0, 4), (0, 1, 1, 4), (1, 0, 2, 4), (1, 1, 3, 4)]
        results = run_threads(specs, run_pipeline_worker)
        assert_same_weights(weights(url, out), weights(url, f"runs/{RUN}/lsgd"))
        assert results[1].val_accuracy == refs[0].val_accuracy
        for r in range(2):
            assert results[2 * r + 1].train_loss == pytest.approx(refs[r].train_loss, rel=1e-6)
    store = open_store(url)
    assert store.list(activation_prefix(RUN, 0)) == []
    assert store.list(f"runs/{RUN}/sync/") == []


def test_a_missing_neighbour_times_out_naming_the_key(staged):
    url, manifest = staged
    [spec] = [s for s in pipeline_worker_specs(
        dataclasses.replace(base_spec(url, 1, f"runs/{RUN}/lonely"),
                            run_id=RUN, sync_timeout_s=0.5),
        cuts=[2], microbatches=2, replicas=1)
        if s.stage.index == 1]
    with pytest.raises(StoreTimeout, match=r"act/e0/r0/it0/f0m0"):
        run_threads([spec], run_pipeline_worker)


@pytest.mark.parametrize("stage, field", [
    ({"cuts": [2], "microbatches": 2}, "stage.index"),
    ({"index": 2, "cuts": [2], "microbatches": 2}, "stage.index"),
    ({"index": 0, "cuts": [2], "microbatches": 2, "replica": 2, "replicas": 2}, "stage.replica"),
    ({"index": 0, "cuts": [2], "microbatches": 2, "sync": "plain"}, "stage.sync"),
    ({"index": 0, "cuts": [2], "microbatches": 1, "actions": ["0F0 0B0", "1B0 1F0"]}, "schedule"),
    ({"index": 0, "cuts": [2], "microbatches": 1, "replicas": 2,
      "actions": ["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"]}, "schedule"),
])
def test_bad_settings_name_the_field(stage, field):
    """Refused before any worker starts (the last: replicas that would never sync)."""
    with pytest.raises(ZooidValueError) as info:
        iteration_schedule(StageSpec.from_dict(stage))
    assert info.value.field == field


def test_an_unknown_collective_is_refused_before_any_worker_starts(staged):
    url, manifest = staged
    base = dataclasses.replace(base_spec(url, 2, "o"), sync=SyncSpec(collective="telepathy"))
    with pytest.raises(ZooidValueError, match="^sync.collective: must be one of"):
        pipeline_worker_specs(base, cuts=[1], microbatches=2, replicas=2)


def test_activations_and_sync_rounds_are_scratch_puts_and_the_checkpoint_is_durable(staged, monkeypatch):
    """The directory store fsyncs only what must outlive a crash of the machine: the epoch's
    checkpoint, not the activations and sync rounds a live peer reads and deletes."""
    from comm.store_dir import DirectoryStore

    url, manifest = staged
    written, lock, write = [], threading.Lock(), DirectoryStore._write

    def recording_write(self, key, data, durable=True):
        with lock:
            written.append((key, durable))
        write(self, key, data, durable)

    monkeypatch.setattr(DirectoryStore, "_write", recording_write)
    out = f"runs/{RUN}/hybrid-durability"
    specs = pipeline_worker_specs(base_spec(url, 2, out), cuts=[1], microbatches=2,
                                  replicas=2)
    run_threads(specs, run_pipeline_worker)
    peers = (activation_prefix(RUN, 0) + "/", f"runs/{RUN}/sync/")  # activations, gradient rounds
    assert any("/it0/f0m0" in k for k, _ in written) and any(k.startswith(peers[1]) for k, _ in written)
    assert [k for k, durable in written if durable and k.startswith(peers)] == []
    assert [k for k, durable in written if not durable and not k.startswith(peers)] == []
    assert (out, True) in written  # the canonical checkpoint is fsynced


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_stage_pipeline_equals_single_process_under_each_schedule(staged, schedule):
    url, manifest = staged
    single = base_spec(url, 1, f"runs/{RUN}/single3")
    run_threads([single], run_local_sgd_epoch)
    out = f"runs/{RUN}/pipe3-{schedule}"
    specs = pipeline_worker_specs(base_spec(url, 1, out), cuts=[1, 2], microbatches=4,
                                  replicas=1, schedule=schedule)
    assert all(s.stage.schedule == schedule for s in specs)
    run_threads(specs, run_pipeline_worker)
    assert_same_weights(weights(url, out), weights(url, f"runs/{RUN}/single3"))


def test_hybrid_under_1f1b_equals_local_sgd_averaging_every_step(staged):
    url, manifest = staged
    local = [dataclasses.replace(base_spec(url, 2, f"runs/{RUN}/lsgd1f1b"), rank=r) for r in range(2)]
    run_threads(local, run_local_sgd_epoch)
    out = f"runs/{RUN}/hybrid-1f1b"
    specs = pipeline_worker_specs(base_spec(url, 2, out), cuts=[1, 2], microbatches=4,
                                  replicas=2, schedule="1f1b")
    run_threads(specs, run_pipeline_worker)
    assert_same_weights(weights(url, out), weights(url, f"runs/{RUN}/lsgd1f1b"))

"""Elastic determinism (issue #44 item 3), counted by sample id: every sample is trained exactly once
per epoch across 2 -> 4 -> 1 workers, and across a resume in the middle of an epoch from 3 workers
to 2, with the dataset prepared in a directory, on S3 (the moto server) and on Azure Blob
(Azurite).

Replicas run as threads of this process (`run_local_sgd_epoch`), reading a prepared dataset whose
inputs carry their id, with a model that records the ids it trains on (`tests.sample_ids`); the
workers' history records add up to the dataset (`engine.replica_data.epoch_coverage`). The 3-worker
phase is stopped by a fault of this process's own (each replica raises before its step 4, its
sync checkpoint at step 4 stored), the 2-worker phase resumes from that checkpoint.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import engine.local_sgd_epoch as local_sgd_epoch
from comm.compression import Compressor, pending
from comm.store import open_store
from comm.store_dir import DirectoryStore
from core.errors import ZooidValueError
from core.keys import residual_key, sync_checkpoint_key, sync_prefix
from core.specs import ComputeSpec, DataSpec, SyncSpec, WorkerSpec
from engine.chaos import Chaos, Fault
from engine.checkpoint import initial_checkpoint, read_checkpoint_meta
from engine.datasets import prepare_dataset
from engine.epoch_order import epoch_steps
from engine.local_sgd_epoch import read_epoch_history, run_local_sgd_epoch
from engine.replica_data import dataset_tally, epoch_coverage
from engine.residuals import read_residual
from tests.bucket_stores import bucket_url
from tests.sample_ids import N_TRAIN, seen

DATA, MODEL, BATCH, PERIOD, SEED = "tests.sample_ids:id_data", "tests.sample_ids:id_recorder", 8, 2, 7
STOP = 4
"""The step before which the 3-worker phase stops (a sync point: PERIOD divides it)."""


def bucket(where: str, tmp_path, request, monkeypatch) -> str:
    """A prefix holding the prepared id dataset: a directory, a moto S3 bucket or an Azurite container."""
    url = bucket_url(where, request, tmp_path, monkeypatch, "ids", "ids")
    store = open_store(url)
    try:
        prepare_dataset(store, "", DATA, subset_size=16)  # 10 shards, the last of 6 rows
    finally:
        store.close()
    return url


def specs(run_store, data: str, run_id: str, epoch: int, world: int, init: str, tag: str,
          **fields) -> list[WorkerSpec]:
    return [WorkerSpec(run_id=run_id, epoch=epoch, rank=r, world=world, store_url=run_store.url, model=MODEL,
                       dataset=data, steps=epoch_steps(N_TRAIN, world, BATCH), batch_size=BATCH, lr=0.1,
                       sync_period=PERIOD, seed=SEED, init_key=init, out_key=f"runs/{run_id}/ckpt/e{epoch}",
                       sync_timeout_s=60.0, data=DataSpec(store=data, cache_mb=1.0),
                       compute=ComputeSpec(model_kwargs={"tag": tag}), **fields)
            for r in range(world)]


def run_threads(store, worker_specs) -> list:
    """Every replica on a thread; each one's result, or the exception it raised."""
    def one(spec):
        try:
            return run_local_sgd_epoch(spec, store)
        except Exception as exc:  # noqa: BLE001 - the caller looks at which
            return exc

    with ThreadPoolExecutor(len(worker_specs)) as pool:
        return list(pool.map(one, worker_specs))


@pytest.mark.parametrize("where", ["dir", "s3", "azure"])
def test_every_sample_once_per_epoch_across_two_four_one_workers(where, tmp_path, request, monkeypatch):
    data = bucket(where, tmp_path, request, monkeypatch)
    store, run_id = DirectoryStore(tmp_path / "run"), f"el-{where}"
    init = f"runs/{run_id}/ckpt/init"
    initial_checkpoint(store, init, MODEL, "sgd", 0.1, seed=SEED, model_kwargs={"tag": ""})
    orders = []
    for epoch, world in enumerate((2, 4, 1)):
        tag = f"{run_id}-e{epoch}"
        results = run_threads(store, specs(store, data, run_id, epoch, world, init, tag))
        assert not [r for r in results if isinstance(r, Exception)], results
        ids = seen(tag)
        assert sorted(ids) == list(range(N_TRAIN))  # counted by id: each sample once, none missing
        assert sum(r.samples for r in results) == N_TRAIN
        assert epoch_coverage(read_epoch_history(store, run_id, epoch)) == dataset_tally(N_TRAIN)
        orders.append(ids)
        init = f"runs/{run_id}/ckpt/e{epoch}"
    assert results[0].val_loss is not None
    assert len({tuple(o) for o in orders}) == 3  # each epoch its own order


class _Stop(Exception):
    """What a replica of this test's stopped phase raises."""


class _StopBefore(Chaos):
    """A fault that raises in the replica's own thread (ZOOID_CHAOS's act on a whole process). Its
    pending fault makes rank 0 store every sync checkpoint before going on, as a planned fault does."""

    def _fire(self, fault, step):
        self.pending.remove(fault)
        raise _Stop(step)


@pytest.mark.parametrize("where,sync_dtype", [("dir", "float32"), ("dir", "int8"), ("s3", "float32"),
                                              ("azure", "float32")])
def test_every_sample_once_across_a_mid_epoch_resume_from_three_workers_to_two(where, sync_dtype, tmp_path,
                                                                              request, monkeypatch):
    data = bucket(where, tmp_path, request, monkeypatch)
    store, run_id = DirectoryStore(tmp_path / "run"), f"mid-{where}-{sync_dtype}"
    init, tag = f"runs/{run_id}/ckpt/init", f"mid-{where}-{sync_dtype}"
    initial_checkpoint(store, init, MODEL, "sgd", 0.1, seed=SEED, model_kwargs={"tag": ""})
    monkeypatch.setattr(local_sgd_epoch, "chaos_for", lambda spec, s=None: _StopBefore(
        spec, s, [Fault(kind="crash_worker", epoch=0, step=STOP)] if spec.world == 3 else []))
    sync = SyncSpec(sync_dtype=sync_dtype)
    stopped = run_threads(store, specs(store, data, run_id, 0, 3, init, tag, sync=sync))
    assert [type(r) for r in stopped] == [_Stop] * 3
    assert sorted(seen(tag)) == sorted(set(seen(tag))) and len(seen(tag)) == 3 * STOP * BATCH
    meta = read_checkpoint_meta(store, sync_checkpoint_key(run_id, 0))
    assert (meta["world"], meta["step"], meta["phases"]) == (3, STOP, [])
    owed = pending([read_residual(store, residual_key(run_id, 0, r, meta["round"])) for r in range(3)]) \
        if sync_dtype == "int8" else None

    started: list[dict] = []
    begin = Compressor.begin

    def record(self, flat, world):
        if not any(s is self for s, _ in started):
            started.append((self, {d: v.clone() for d, v in self.residual.items()}))
        begin(self, flat, world)

    monkeypatch.setattr(Compressor, "begin", record)
    store.delete_prefix(sync_prefix(run_id, 0) + "/")  # as the coordinator does before every attempt
    resumed = run_threads(store, specs(store, data, run_id, 0, 2, init, tag, sync=sync, resume=True))
    assert not [r for r in resumed if isinstance(r, Exception)], resumed
    ids = seen(tag)
    assert sorted(ids) == list(range(N_TRAIN))  # every sample once across both phases
    assert sum(r.samples for r in resumed) == N_TRAIN - 3 * STOP * BATCH
    history = read_epoch_history(store, run_id, 0)
    assert [(h["rank"], h["world"], h["phases"], h["start_step"]) for h in history] == [
        (0, 2, [{"world": 3, "batch": BATCH, "steps": STOP}], 0), (1, 2, [{"world": 3, "batch": BATCH, "steps": STOP}], 0)]
    assert epoch_coverage(history) == dataset_tally(N_TRAIN)
    end = read_checkpoint_meta(store, f"runs/{run_id}/ckpt/e0")
    # 54 samples left for 2 replicas of 8: 3 full steps and one of 3 each
    assert end["global_step"] == STOP + 4 and end["position"]["step"] == 4
    if sync_dtype == "int8":  # each new rank continued its slice of what the 3 old ones owed
        assert len(started) == 2 and owed["float32"].abs().max() > 0
        torch.testing.assert_close(sum(r["float32"] for _, r in started), owed["float32"], rtol=0, atol=0)
        assert end["residual_keys"] == [residual_key(run_id, 0, r, end["position"]["round"]) for r in range(2)]


def test_a_compressed_sync_refuses_to_continue_a_lone_replica_s_epoch_with_another_world(tmp_path, monkeypatch):
    data = bucket("dir", tmp_path, None, monkeypatch)
    store, run_id = DirectoryStore(tmp_path / "run"), "lone"
    init = f"runs/{run_id}/ckpt/init"
    initial_checkpoint(store, init, MODEL, "sgd", 0.1, seed=SEED, model_kwargs={"tag": ""})
    monkeypatch.setattr(local_sgd_epoch, "chaos_for", lambda spec, s=None: _StopBefore(
        spec, s, [Fault(kind="crash_worker", epoch=0, step=STOP)] if spec.world == 1 else []))
    sync = SyncSpec(sync_dtype="int8")
    [stopped] = run_threads(store, specs(store, data, run_id, 0, 1, init, "lone", sync=sync))
    assert isinstance(stopped, _Stop)
    results = run_threads(store, specs(store, data, run_id, 0, 2, init, "lone", sync=sync, resume=True))
    assert all(isinstance(r, ZooidValueError) and r.field == "workers" for r in results), results


def test_a_worker_whose_steps_are_not_a_fresh_epoch_s_is_refused_naming_steps(tmp_path, monkeypatch):
    """150 samples, batch 8: 10 steps for 2 replicas (a Local-SGD world or a hybrid's D); 9 is refused
    in one line before training, by a replica and by a pipeline stage."""
    from engine.pipeline_executor import pipeline_worker_specs, run_pipeline_worker

    data = bucket("dir", tmp_path, None, monkeypatch)
    store = DirectoryStore(tmp_path / "run")
    initial_checkpoint(store, "runs/st/ckpt/init", MODEL, "sgd", 0.1, seed=SEED, model_kwargs={"tag": ""})
    [spec, _] = specs(store, data, "st", 0, 2, "runs/st/ckpt/init", "st")
    assert spec.steps == 10
    message = "steps: an epoch of 150 samples takes 10 steps for 2 replicas of batch 8, got 9"
    with pytest.raises(ZooidValueError) as info:
        run_local_sgd_epoch(dataclasses.replace(spec, steps=9), store)
    assert str(info.value) == message
    stage = pipeline_worker_specs(dataclasses.replace(spec, steps=9, model="digits_mlp", compute=ComputeSpec()),
                                  cuts=[2], microbatches=2, replicas=2)[0]  # the check comes before any row is read
    with pytest.raises(ZooidValueError) as info:
        run_pipeline_worker(stage, store)
    assert str(info.value) == message
    assert seen("st") == []


def test_a_sync_checkpoint_s_phases_place_a_relaunch_and_another_world(tmp_path):
    """A sync checkpoint of 2 replicas at step 2 that continued 3 replicas' 4 steps: a relaunch of the
    same world resumes at its step with the same earlier phase; 4 replicas start a third phase after
    both; a spec differing in more than its world (the batch) starts the epoch from its init key."""
    from engine.checkpoint import save_checkpoint
    from engine.epoch_order import Phase
    from engine.local_sgd_epoch import _position_identity, load_start_point
    from engine.models import build_model
    from engine.optimizers import build_optimizer

    store = DirectoryStore(tmp_path)
    model = build_model(MODEL, SEED, tag="")
    optimizer = build_optimizer("sgd", model, 0.1)
    save_checkpoint(store, "runs/ph/ckpt/init", model, optimizer, {"global_step": 40})
    [spec, _] = specs(store, "file:///unused", "ph", 0, 2, "runs/ph/ckpt/init", "ph", resume=True)
    meta = {**_position_identity(spec), "step": 2, "round": 0, "global_step_before": 40,
            "phases": [Phase(3, BATCH, 4).to_dict()]}
    save_checkpoint(store, sync_checkpoint_key("ph", 0), model, optimizer, meta)

    def start(**fields):
        return load_start_point(dataclasses.replace(spec, **fields), store, model, optimizer)

    same = start(attempt=1, resume=False)
    assert (same.step, same.round, same.phases, same.from_sync_checkpoint) == (2, 1, (Phase(3, BATCH, 4),), True)
    wider = start(world=4, steps=epoch_steps(N_TRAIN, 4, BATCH))
    assert (wider.step, wider.round, wider.phases) == (0, 1, (Phase(3, BATCH, 4), Phase(2, BATCH, 2)))
    assert wider.global_step_before == 40
    other = start(world=4, batch_size=16, steps=epoch_steps(N_TRAIN, 4, 16))
    assert (other.step, other.phases, other.from_sync_checkpoint) == (0, (), False)

"""The store requests of one Local-SGD epoch and one pipeline epoch equal a count derived by
hand from the protocol (issue #45), and, for the Local-SGD epoch over S3 and Azure Blob, the
store's own log (moto's recording, Azurite's access log).

Each worker gets its own client of the scratch store (its sync or stage traffic alone), and the
data and checkpoints live in another store, so the scratch client's count is the protocol's:

- one store allreduce (`comm.collectives`, plain or pipelined, a group that is not replayed),
  per rank of W: W puts (a part for each other rank, its reduced slice), 2 (W - 1) gets (the
  parts of its slice, the other reduced slices), W - 1 deletes (its slice's parts) and one more
  from the second call on (its previous reduced slice);
- the group's release (`release_group`): a done key from every rank; rank 0 reads the W - 1
  others, lists and deletes what is left of the calls (the last call's W reduced slices), then
  lists and deletes the done keys (W);
- misses (a waiting get's polls) depend on timing and are counted apart (`StoreOps.miss`).
"""
from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from comm.store_dir import DirectoryStore
from core.keys import worker_history_key
from core.kinds import Strategy
from core.plan import Plan
from core.specs import DataSpec, SyncSpec, WorkerSpec
from core.store_ops import StoreOps, total
from engine.checkpoint import initial_checkpoint
from engine.datasets import publish_dataset, read_manifest
from engine.epoch_order import epoch_steps
from planners.store_requests import epoch_store_ops
from tests.store_logs import LoggingAzurite, RecordingS3

SMALL = "synthetic:64:10:96:32"
"""96 training rows of digits' width."""


def allreduce_ops(world: int, calls: int) -> StoreOps:
    """One rank's requests for `calls` store allreduce calls of a group that is not replayed."""
    return StoreOps(put=world * calls, get=2 * (world - 1) * calls, delete=(world - 1) * calls + (calls - 1))


def release_ops(world: int, rank: int, store) -> StoreOps:
    """One rank's requests to release the group (`comm.collectives.release_group`): rank 0's
    two prefix deletes take the store's own delete requests for W keys each (one per key in a
    directory, one DeleteObjects on S3)."""
    if rank:
        return StoreOps(put=1)
    return StoreOps(put=1, get=world - 1, list=2, delete=2 * store._delete_requests(world))


def protocol_only(ops: StoreOps) -> StoreOps:
    """The counts a protocol fixes: without misses (timing) and bytes."""
    return dataclasses.replace(ops, miss=0, bytes_in=0, bytes_out=0)


def _durable(tmp_path, run_id: str, durable=None):
    durable = durable if durable is not None else DirectoryStore(tmp_path / "durable")
    publish_dataset(durable, run_id, SMALL, subset_size=16)
    initial_checkpoint(durable, f"runs/{run_id}/ckpt/init", "digits_mlp", "sgd", lr=0.1, seed=1)
    return durable


def _local_sgd_epoch(scratch_stores, durable, run_id: str, world: int, batch: int, period: int, collective: str):
    """One Local-SGD epoch of `world` threads (`runtime.run_spec`), rank r syncing through
    `scratch_stores[r]`."""
    from runtime.run_spec import run_spec

    steps = epoch_steps(read_manifest(durable, run_id).n_train, world, batch)
    specs = [WorkerSpec(rank=r, world=world, store_url=scratch_stores[r].url, checkpoint_store=durable.url,
                        run_id=run_id, epoch=0, model="digits_mlp", dataset=SMALL, steps=steps, batch_size=batch,
                        lr=0.1, optimizer="sgd", sync_period=period, seed=1, init_key=f"runs/{run_id}/ckpt/init",
                        out_key=f"runs/{run_id}/ckpt/e0", evaluate=False,
                        sync=SyncSpec(collective=collective, checkpoint_every=0, repost_s=0.0))
             for r in range(world)]
    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(lambda s: run_spec(s, scratch_stores[s.rank]), specs))
    return steps, results


@pytest.mark.parametrize("collective,period", [("plain", 2), ("pipelined", 2), ("plain", 1)])
def test_local_sgd_epoch_requests_equal_the_protocols(tmp_path, collective, period):
    """Period 2: parameters averaged every other step; period 1: gradients averaged every step
    (one bucket for this model), one call a step all the same."""
    world, batch, run_id = 3, 8, "bill-lsgd"
    durable = _durable(tmp_path, run_id)
    scratch = [DirectoryStore(tmp_path / "scratch") for _ in range(world)]
    steps, _ = _local_sgd_epoch(scratch, durable, run_id, world, batch, period, collective)
    calls = math.ceil(steps / period)  # the last, shorter period is flushed at the end
    assert steps == 4 and calls == 4 // period
    for rank, store in enumerate(scratch):
        # and its history record, which goes with its tensors (`core.keys.RECORDS`)
        expected = allreduce_ops(world, calls) + release_ops(world, rank, store) + StoreOps(put=1)
        got = protocol_only(store.ops)
        if rank == 0:  # rank 0 also lists once for each second it waited on a done key
            assert got.list >= expected.list
            got = dataclasses.replace(got, list=expected.list)
        assert got == expected, rank
    assert scratch[0].list("runs/") == [worker_history_key(run_id, 0, r, 0) for r in range(world)]
    # the run prediction's count (`planners.store_requests`) is the same protocol: the scratch
    # store's requests, the replicas' history records included, plus the initial checkpoint's
    # reads and the epoch checkpoint on the durable store
    plan = Plan(strategy=Strategy.LOCAL_SGD, data_parallel=world, steps_per_epoch=steps, sync_period=period)
    measured = total(protocol_only(s.ops) for s in scratch)
    measured = dataclasses.replace(measured, list=2)  # rank 0's two listings, waits aside
    assert epoch_store_ops(plan, checkpoint_every=0) == measured + StoreOps(get=world, put=1)


def _logging_server(kind: str, tmp_path):
    """(server, bucket or container, store factory, where) for a store that logs its requests."""
    workdir = tmp_path / kind
    workdir.mkdir()
    if kind == "s3":
        from comm.store_s3 import S3Store

        server = RecordingS3(workdir)
        server.start()
        name = server.create_bucket("zooid-epoch")
        return server, name, lambda prefix="scratch": S3Store(name, prefix, endpoint=server.endpoint), f"s3://{name}"
    from comm.store_azure import AzureBlobStore

    server = LoggingAzurite(workdir)
    try:
        server.start()
    except FileNotFoundError:
        pytest.skip("Azurite is not installed (make azurite)")
    name = server.create_container("zooid-epoch")
    return (server, name, lambda prefix="scratch": AzureBlobStore(name, prefix, connection_string=server.connection_string()),
            f"az://{name}")


@pytest.mark.parametrize("kind", ["s3", "azure"])
def test_local_sgd_epoch_requests_equal_the_stores_own_log(tmp_path, kind):
    """moto's recording, Azurite's access log: request for request what the workers counted."""
    world, batch, period, run_id = 3, 8, 2, f"bill-{kind}"
    server, name, open_scratch, where = _logging_server(kind, tmp_path)
    try:
        server.reset()
        scratch = [open_scratch() for _ in range(world)]
        durable = _durable(tmp_path, run_id)
        steps, results = _local_sgd_epoch(scratch, durable, run_id, world, batch, period, "plain")
        counted = total(s.ops for s in scratch)
        logged = server.ops(name)
    finally:
        server.stop()
    assert dataclasses.replace(counted, get=counted.get + counted.miss, miss=0, bytes_in=0, bytes_out=0) == logged
    # the protocol's count, every rank together (misses and rank 0's waits aside), and each
    # replica's history record
    expected = total(allreduce_ops(world, math.ceil(steps / period)) + release_ops(world, r, scratch[r])
                     + StoreOps(put=1) for r in range(world))
    assert dataclasses.replace(protocol_only(counted), list=expected.list) == expected
    # each worker's result carries its epoch's requests by store: the scratch store's, and
    # the directory's (data and checkpoints)
    for r in results:
        assert r.store_ops[where] == scratch[r.rank].ops.to_dict()
        assert r.store_ops["file://"]["get"] > 0


@pytest.mark.parametrize("kind", ["s3", "azure"])
def test_local_sgd_epoch_results_equal_the_stores_log_data_and_checkpoints_included(tmp_path, kind, monkeypatch):
    """Data, checkpoints and history in the logged store too (under another prefix, which each
    worker opens from its URL): the workers' results, summed, are every request the store
    logged in the epoch (and the manifest this test reads)."""
    world, batch, period, run_id = 2, 8, 2, f"bill-all-{kind}"
    server, name, open_store_here, where = _logging_server(kind, tmp_path)
    if kind == "azure":  # how a worker reopens an az:// URL
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string())
    try:
        durable = _durable(tmp_path, run_id, open_store_here("durable"))
        server.reset()
        before = durable.ops  # this test's own client reads the manifest (the epoch's steps)
        scratch = [open_store_here() for _ in range(world)]
        _, results = _local_sgd_epoch(scratch, durable, run_id, world, batch, period, "pipelined")
        logged = server.ops(name)
    finally:
        server.stop()
    reported = total(r.store_ops[where] for r in results) + (durable.ops - before)
    assert dataclasses.replace(reported, get=reported.get + reported.miss, miss=0, bytes_in=0, bytes_out=0) == logged
    syncs = total(protocol_only(s.ops) for s in scratch)
    assert logged.put > syncs.put and logged.get > syncs.get  # checkpoints, history and data beside the syncs


def test_pipeline_epoch_requests_equal_the_protocols(tmp_path):
    """Two stage workers (gpipe), M micro-batches, S steps; the data is a prepared dataset in
    another store. Per step stage 0 posts M activations and reads (and deletes) M gradients,
    stage 1 the other way round; after training stage 1 posts the loss for stage 0 (read and
    deleted); validation sends C chunks' activations; stage 0 posts its weights for the
    checkpoint, which stage 1 reads, deletes and writes whole. Both read the initial checkpoint."""
    from engine.datasets import prepare_dataset
    from engine.pipeline_executor import pipeline_worker_specs
    from runtime.run_spec import run_spec

    run_id, batch, micro = "bill-pipe", 16, 4
    data = DirectoryStore(tmp_path / "data")
    manifest = prepare_dataset(data, "", SMALL, subset_size=16).manifest
    scratch = [DirectoryStore(tmp_path / "run") for _ in range(2)]
    initial_checkpoint(DirectoryStore(tmp_path / "run"), f"runs/{run_id}/init", "digits_mlp", "sgd", lr=0.1, seed=1)
    steps = epoch_steps(manifest.n_train, 1, batch)
    base = WorkerSpec(run_id=run_id, epoch=0, rank=0, world=1, store_url=scratch[0].url, model="digits_mlp",
                      dataset=SMALL, steps=steps, batch_size=batch, lr=0.1, optimizer="sgd", sync_period=1, seed=1,
                      init_key=f"runs/{run_id}/init", out_key=f"runs/{run_id}/e0",
                      data=DataSpec(store=data.url))
    specs = pipeline_worker_specs(base, cuts=[2], microbatches=micro)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda s: run_spec(s, scratch[s.stage.index]), specs))
    chunks = math.ceil(manifest.n_val / specs[0].stage.val_chunk)
    sm = steps * micro
    assert steps == 6 and chunks == 1
    first = StoreOps(get=1 + sm + 1, put=sm + chunks + 1, delete=sm + 1)
    last = StoreOps(get=1 + sm + chunks + 1, put=sm + 1 + 1, delete=sm + chunks + 1)
    assert [protocol_only(s.ops) for s in scratch] == [first, last]
    # the run prediction's count (`planners.store_requests`): the same, validation aside
    plan = Plan(strategy=Strategy.PIPELINE, data_parallel=1, stages=2, cuts=(2,), microbatches=micro,
                steps_per_epoch=steps)
    assert epoch_store_ops(plan) == first + last - StoreOps(put=chunks, get=chunks, delete=chunks)
    assert results[1].checkpoint_key == f"runs/{run_id}/e0"
    for w in range(2):  # a result counts the data store's reads too (both directories: `file://`)
        assert results[w].store_ops["file://"]["get"] > scratch[w].ops.get
    assert scratch[0].list(f"runs/{run_id}/act/") == []


@pytest.mark.parametrize("period", [2, 1])
def test_a_local_sgd_epoch_over_the_ring_makes_its_rendezvous_and_release_requests(tmp_path, period):
    """Over the ring the scratch store sees the rendezvous (rank 0 publishes its address, the
    others read it) and the group's release, whose first prefix delete finds the address key
    alone: rank 0 2 puts, 2 gets, 2 listings, 1 + 3 deletes; the others a get and a put each;
    and every replica's history record."""
    world, batch, run_id = 3, 8, "bill-ring"
    durable = _durable(tmp_path, run_id)
    scratch = [DirectoryStore(tmp_path / "scratch") for _ in range(world)]
    from runtime.run_spec import run_spec

    steps = epoch_steps(read_manifest(durable, run_id).n_train, world, batch)
    sync = SyncSpec(collective="ring", ring_host="127.0.0.1", ring_timeout_s=30.0, checkpoint_every=0, repost_s=0.0)
    specs = [WorkerSpec(rank=r, world=world, store_url=scratch[r].url, checkpoint_store=durable.url, run_id=run_id,
                        epoch=0, model="digits_mlp", dataset=SMALL, steps=steps, batch_size=batch, lr=0.1,
                        optimizer="sgd", sync_period=period, seed=1, init_key=f"runs/{run_id}/ckpt/init",
                        out_key=f"runs/{run_id}/ckpt/e0", evaluate=False, sync=sync) for r in range(world)]
    with ThreadPoolExecutor(world) as pool:
        list(pool.map(lambda s: run_spec(s, scratch[s.rank]), specs))
    got = [protocol_only(s.ops) for s in scratch]
    assert dataclasses.replace(got[0], list=2) == StoreOps(put=2 + 1, get=2, list=2, delete=1 + 3)
    assert got[0].list >= 2  # and once for each second it waited on a done key
    assert got[1:] == [StoreOps(put=1 + 1, get=1)] * 2
    assert scratch[0].list("runs/") == [worker_history_key(run_id, 0, r, 0) for r in range(world)]
    plan = Plan(strategy=Strategy.LOCAL_SGD, data_parallel=world, steps_per_epoch=steps, sync_period=period)
    measured = dataclasses.replace(total(got), list=2)
    assert epoch_store_ops(plan, ring=True, checkpoint_every=0) == measured + StoreOps(get=world, put=1)

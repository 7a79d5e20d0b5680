"""Whole training runs whose `store` and `durable_store` are an Azure Blob store block on a real
Blob API (Azurite): Local-SGD with 2 workers and a 2-stage pipeline train, bill and clean up;
an Azurite restart in the middle of a run loses nothing; and the account key, which lives in
the block only, reaches no environment, argument, log line (at INFO), artifact, parameter,
worker log or stored object."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import subprocess
import threading
import types
import uuid

import pytest
import torch

from coordinator.run.job import TrainJob

pytestmark = pytest.mark.usefixtures("prefect_api")
JOB = dict(workers=2, epochs=2, optimizer="sgd", lr=0.1, sync_period=4, batch_size=32, strategy="local_sgd",
           sync_checkpoint_s=0.0)  # a sync checkpoint every round: the faults below resume from one


def _save_block(azurite, name: str) -> tuple[str, str]:
    """A zooid-azure-blob-store block on a fresh container: (the job's store name, container)."""
    from prefect_azure.credentials import AzureBlobStorageCredentials

    from blocks.store_block_azure import ZooidAzureBlobStore

    container = azurite.create_container(f"zooid-{uuid.uuid4().hex[:12]}")
    ZooidAzureBlobStore(credentials=AzureBlobStorageCredentials(connection_string=azurite.connection_string()),
                        container=container, prefix="zooid").save(name, overwrite=True)
    return f"zooid-azure-blob-store/{name}", container


def _container(azurite, container: str):
    from azure.storage.blob import BlobServiceClient

    return BlobServiceClient.from_connection_string(azurite.connection_string()).get_container_client(container)


def _final_weights(store, key: str) -> dict[str, torch.Tensor]:
    from comm.tensor_codec import decode_tensors

    tensors, _ = decode_tensors(store.get(key))
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


def _open(store_name: str):
    from blocks.store_block import block_ref
    from blocks.store_refs import open_store_ref

    return open_store_ref(block_ref(store_name))


@pytest.fixture(scope="module")
def local_sgd_run(azurite, tmp_path_factory):
    """Local-SGD, 2 workers, on the block: at INFO everywhere, with every worker process's
    environment and arguments and everything the run printed kept for the secret test."""
    import coordinator.workers.launchers
    from flows.train import train

    store_name, container = _save_block(azurite, "azure-run")
    launched: list[tuple[list[str], dict[str, str]]] = []

    def popen(args, *rest, env=None, **kw):  # the real Popen; the spy keeps what a worker got
        launched.append((list(args), dict(env or os.environ)))
        return subprocess.Popen(args, *rest, env=env, **kw)

    loggers = [logging.getLogger(n) for n in ("prefect.flow_runs", "prefect.task_runs")]
    levels = [lg.level for lg in loggers]
    saved_env = {k: os.environ.get(k) for k in ("PREFECT_LOGGING_LEVEL", "ZOOID_HOME")}
    os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"  # the workers log at INFO too
    os.environ["ZOOID_HOME"] = str(tmp_path_factory.mktemp("azure-home"))
    real = coordinator.workers.launchers.subprocess
    coordinator.workers.launchers.subprocess = types.SimpleNamespace(**{**vars(real), "Popen": popen})
    printed = io.StringIO()
    handler = logging.StreamHandler(printed)  # every line the flows and tasks log or print, at INFO
    handler.setLevel(logging.INFO)
    try:
        for lg in loggers:
            lg.setLevel(logging.INFO)
            lg.addHandler(handler)
        summary = train(TrainJob(store=store_name, durable_store=store_name, **JOB))
    finally:
        coordinator.workers.launchers.subprocess = real
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
            lg.removeHandler(handler)
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    home = tmp_path_factory.getbasetemp()
    worker_logs = [p.read_text(errors="replace") for p in home.rglob(f"logs/{summary.run_id}/*.log")]
    return types.SimpleNamespace(summary=summary, store_name=store_name, container=container,
                                 launched=launched, printed=printed.getvalue(), worker_logs=worker_logs)


def test_local_sgd_trains_on_azure_blob(azurite, local_sgd_run):
    from coordinator.bill.cost import read_ledger

    summary = local_sgd_run.summary
    assert summary.status == "completed" and summary.plan["strategy"] == "local_sgd"
    assert summary.plan["data_parallel"] == 2 and len(summary.epochs) == 2
    assert summary.final_accuracy > 0.5 and summary.total_cost_usd > 0
    store = _open(local_sgd_run.store_name)
    assert store.exists(summary.checkpoint_key)  # the checkpoint is a blob in the container
    assert read_ledger(store, summary.run_id)["total_usd"] == pytest.approx(summary.total_cost_usd)
    blobs = list(_container(azurite, local_sgd_run.container).list_blob_names(
        name_starts_with=f"zooid/runs/{summary.run_id}/"))
    assert f"zooid/{summary.checkpoint_key}" in blobs
    assert not [b for b in blobs if "/sync/" in b or "/act/" in b]  # teardown removed the scratch keys
    print(f"\nAzure Blob Local-SGD 2 workers: {summary.status}, {len(summary.epochs)} epochs, "
          f"accuracy {summary.final_accuracy:.4f}, loss {summary.final_loss:.4f}, ${summary.total_cost_usd:.6f}")


def test_the_account_key_is_in_no_environment_log_artifact_parameter_or_object(azurite, local_sgd_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    key = azurite.account_key
    run = local_sgd_run
    run_id = run.summary.run_id

    async def every(read, **kw) -> list:  # the API answers 200 rows a page
        rows: list = []
        while page := await read(limit=200, offset=len(rows), **kw):
            rows += page
        return rows

    async def prefect_holds() -> tuple[str, int]:
        async with get_client() as client:
            logs = await every(client.read_logs, log_filter=LogFilter())
            artifacts = await every(client.read_artifacts)
            flows = await every(client.read_flow_runs)
            tasks = await every(client.read_task_runs)
        info = sum(log.level == logging.INFO for log in logs)
        text = [log.message for log in logs] + [json.dumps(a.data, default=str) + str(a.description)
                                                 for a in artifacts]
        text += [json.dumps(r.parameters, default=str) for r in flows]
        text += [json.dumps(t.task_inputs, default=str) + str(t.name) for t in tasks]
        return "\n".join(text), info

    seen, info_lines = asyncio.run(prefect_holds())
    assert run_id in seen and info_lines > 0  # this run's INFO logs and artifacts were read
    assert "epoch 2/2" in run.printed and "profile of digits_mlp" in run.printed  # the flows' printed lines
    assert run.launched and run.worker_logs  # every worker process started, and its own log
    blobs = _container(azurite, run.container)
    written = [blobs.download_blob(name).readall() for name in blobs.list_blob_names()]
    assert len(written) > 3  # checkpoints, subsets, ledger, history, summary
    for data in written:
        assert key.encode() not in data
    for args, env in run.launched:
        assert all(key not in a for a in args) and all(key not in v for v in env.values())
    for text in [seen, run.printed, *run.worker_logs, *os.environ.values()]:
        assert key not in text
    # the run went through the block's key: Azurite refuses any other
    from comm.store_azure import AzureBlobStore
    from core.errors import StoreError

    wrong = AzureBlobStore(run.container, "zooid", connection_string=azurite.connection_string(
        "V3Jvbmcta2V5LW5vdC10aGUtYWNjb3VudHMtb3duLWtleS0wMDAwMDAwMDAwMDA="))
    with pytest.raises(StoreError, match="AuthorizationFailure"):
        wrong.get(run.summary.checkpoint_key)


@pytest.mark.slow
def test_an_azurite_restart_mid_run_loses_nothing(azurite, local_sgd_run):
    """Azurite stops and starts again once the first sync point's checkpoint is a blob: the
    workers' requests retry across it, and the run ends where the undisturbed run ends."""
    from core.keys import sync_checkpoint_key
    from flows.train import train

    store_name, container = _save_block(azurite, "azure-restart")
    blobs = _container(azurite, container)
    stop, seen_at_restart = threading.Event(), []

    def restart_after_the_first_sync_point():
        while not stop.is_set():
            with contextlib.suppress(Exception):
                names = list(blobs.list_blob_names(name_starts_with="zooid/runs/"))
                if any(n.endswith(sync_checkpoint_key("x", 0).split("/", 2)[2]) for n in names):
                    seen_at_restart.extend(names)
                    azurite.restart()
                    return
            stop.wait(0.05)

    watcher = threading.Thread(target=restart_after_the_first_sync_point, daemon=True)
    pid_before = azurite.proc.pid
    watcher.start()
    try:
        summary = train(TrainJob(store=store_name, durable_store=store_name, **JOB))
    finally:
        stop.set()
        watcher.join(timeout=60)
    assert seen_at_restart and azurite.proc.pid != pid_before  # it did restart, during the run
    assert f"zooid/{summary.checkpoint_key}" not in seen_at_restart  # before the final checkpoint
    assert summary.status == "completed" and len(summary.epochs) == 2
    clean = local_sgd_run.summary
    weights = _final_weights(_open(store_name), summary.checkpoint_key)
    for k, v in _final_weights(_open(local_sgd_run.store_name), clean.checkpoint_key).items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6)
    assert summary.final_accuracy == pytest.approx(clean.final_accuracy, abs=0.01)
    assert list(blobs.list_blob_names(name_starts_with=f"zooid/runs/{summary.run_id}/ckpt/"))


@pytest.mark.slow
def test_a_two_stage_pipeline_trains_on_azure_blob(azurite):
    from flows.train import train

    store_name, container = _save_block(azurite, "azure-pipeline")
    summary = train(TrainJob(store=store_name, durable_store=store_name, epochs=1, optimizer="sgd", lr=0.1,
                             batch_size=16, strategy="pipeline", stages=2, microbatches=4, prestart=False))
    assert summary.status == "completed" and (summary.plan["strategy"], summary.plan["stages"]) == ("pipeline", 2)
    assert summary.final_accuracy > 0.5 and summary.total_cost_usd > 0
    blobs = list(_container(azurite, container).list_blob_names(name_starts_with=f"zooid/runs/{summary.run_id}/"))
    assert f"zooid/{summary.checkpoint_key}" in blobs and not [b for b in blobs if "/act/" in b]
    print(f"\nAzure Blob pipeline 2 stages: {summary.status}, accuracy {summary.final_accuracy:.4f}, "
          f"${summary.total_cost_usd:.6f}")

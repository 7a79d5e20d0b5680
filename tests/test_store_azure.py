"""The Azure Blob store's own behaviour against a real Blob API (Azurite): its URL forms, large
values as staged blocks, errors that name container and key but never the credential, the
block that hands its key to the client, and a restart survived. The Store contract itself is
`tests/test_stores.py`, parametrised over every store."""
from __future__ import annotations

import json
import os
import threading
import uuid

import pytest
from azure.storage.blob import BlobServiceClient

from blocks.store_block_azure import ZooidAzureBlobStore
from comm.store import open_store
from comm.store_azure import AzureBlobStore
from core.errors import StoreError, ZooidValueError
from tests.conftest import free_port

MIB = 1024 * 1024
WRONG_KEY = "V3Jvbmcta2V5LW5vdC10aGUtYWNjb3VudHMtb3duLWtleS0wMDAwMDAwMDAwMDA="


def _container(azurite) -> str:
    return azurite.create_container(f"zooid-{uuid.uuid4().hex[:12]}")


def _block(azurite, container: str, key: str | None = None) -> ZooidAzureBlobStore:
    from prefect_azure.credentials import AzureBlobStorageCredentials

    creds = AzureBlobStorageCredentials(connection_string=azurite.connection_string(key))
    return ZooidAzureBlobStore(credentials=creds, container=container, prefix="runs-test")


def test_open_store_reads_az_urls(azurite, monkeypatch):
    container = _container(azurite)
    store = open_store(f"az://{container}/pre/fix", azure_account={"connection_string": azurite.connection_string()})
    assert isinstance(store, AzureBlobStore) and store.prefix == "pre/fix/" and store.url == f"az://{container}/pre/fix"
    store.ping()
    store.put("runs/r/k", b"v")
    raw = BlobServiceClient.from_connection_string(azurite.connection_string())
    assert raw.get_blob_client(container, "pre/fix/runs/r/k").download_blob().readall() == b"v"
    # from the command line: the SDK's documented variable, read when the URL names no account
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    assert open_store(f"az://{container}/pre/fix").get("runs/r/k") == b"v"
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    with pytest.raises(ZooidValueError, match=r"^store: az://.* needs a storage account"):
        open_store(f"az://{container}/pre/fix")
    with pytest.raises(ZooidValueError, match=r"^store: unknown Azure Blob URL parameter"):
        open_store(f"az://{container}/p?endpoint=x", azure_account={"connection_string": azurite.connection_string()})
    with pytest.raises(ZooidValueError, match=r"^store: an Azure Blob store needs a container"):
        open_store("az:///p", azure_account={"connection_string": azurite.connection_string()})


def test_a_large_value_is_uploaded_as_staged_blocks_and_committed_at_once(azurite):
    container = _container(azurite)
    store = AzureBlobStore(container, "p", connection_string=azurite.connection_string(), single_put_bytes=MIB)
    data = os.urandom(20 * MIB + 5)
    store.put("runs/r/ckpt", data)
    committed, uncommitted = store.blobs.get_blob_client("p/runs/r/ckpt").get_block_list("all")
    assert [b.size for b in committed] == [8 * MIB, 8 * MIB, 4 * MIB + 5] and not uncommitted
    assert store.get("runs/r/ckpt") == data
    store.put("runs/r/small", b"x" * 1000)  # below the threshold: one Put Blob, no blocks
    assert store.blobs.get_blob_client("p/runs/r/small").get_block_list("all") == ([], [])
    store.close()


def test_server_errors_name_container_and_key_never_the_credential(azurite):
    container = _container(azurite)
    wrong = AzureBlobStore(container, "p", connection_string=azurite.connection_string(WRONG_KEY))
    with pytest.raises(StoreError) as refused:
        wrong.put("runs/r/k", b"v")
    message = str(refused.value)
    assert container in message and "runs/r/k" in message and "AuthorizationFailure" in message
    missing = AzureBlobStore(f"no-such-{uuid.uuid4().hex[:8]}", "p", connection_string=azurite.connection_string())
    with pytest.raises(StoreError) as absent:
        missing.get("runs/r/k")
    assert "ContainerNotFound" in str(absent.value) and missing.container in str(absent.value)
    with pytest.raises(StoreError, match="ContainerNotFound"):
        missing.ping()
    for text in (message, str(absent.value), repr(wrong)):
        assert WRONG_KEY not in text and azurite.account_key not in text


def test_ping_makes_one_short_attempt_at_an_unreachable_account(azurite):
    closed = free_port()
    store = AzureBlobStore("zooid", connection_string=azurite.connection_string().replace(
        f":{azurite.port}/", f":{closed}/"))
    with pytest.raises(StoreError, match="unreachable"):
        store.ping()
    policy = store._ping_blobs._pipeline._impl_policies  # the ping client's retry policy: none
    retry = next(p for p in policy if type(p).__name__ == "LinearRetry")
    assert retry.total_retries == 0 and retry.connect_retries == 0


def test_the_block_hands_its_key_to_the_client_and_a_wrong_key_is_refused(azurite):
    container = _container(azurite)
    env = dict(os.environ)
    block = _block(azurite, container)
    assert block.url() == f"az://{container}/runs-test"
    shown = block.url() + repr(block) + str(block.worker_environment())
    assert azurite.account_key not in shown
    store = block.open()
    try:
        store.put("runs/z1/probe/x", b"\x00\x01")
        assert store.get("runs/z1/probe/x") == b"\x00\x01"
        assert store.client.credential.account_key == azurite.account_key  # the block's key signed it
    finally:
        store.close()
    wrong = _block(azurite, container, WRONG_KEY).open()
    with pytest.raises(StoreError, match="AuthorizationFailure"):
        wrong.ping()  # Azurite checks the signature: only the account's key gets in
    assert dict(os.environ) == env  # nothing was put into the environment


def test_the_block_of_an_account_url_names_it_without_a_secret():
    from prefect_azure.credentials import AzureBlobStorageCredentials

    block = ZooidAzureBlobStore(container="c0n", credentials=AzureBlobStorageCredentials(
        account_url="https://acct.blob.core.windows.net", client_id="i", tenant_id="t", client_secret="sp-s3cr3t"))
    assert block.url() == "az://c0n/zooid?account_url=https://acct.blob.core.windows.net"
    assert "sp-s3cr3t" not in block.url() + repr(block)


def test_a_store_survives_an_azurite_restart(azurite, monkeypatch):
    """A put while Azurite is down fails, backs off and retries; Azurite starts again only
    after the store has retried (an event), and the put lands with nothing lost."""
    from azure.storage.blob._shared.policies import StorageRetryPolicy

    container = _container(azurite)
    store = AzureBlobStore(container, "p", connection_string=azurite.connection_string())
    store.put("runs/r1/before", b"kept")
    retrying, real_sleep = threading.Event(), StorageRetryPolicy.sleep

    def sleep(policy, settings, transport):  # the client's pause after a failed try
        retrying.set()
        real_sleep(policy, settings, transport)

    monkeypatch.setattr(StorageRetryPolicy, "sleep", sleep)
    azurite.stop()
    restart = threading.Thread(target=lambda: retrying.wait(60) and azurite.start())
    restart.start()
    try:
        store.put("runs/r1/after", b"written across the restart")
        assert retrying.is_set()  # the put did meet Azurite down
    finally:
        retrying.set()
        restart.join()
        if azurite.proc is None:
            azurite.start()
    assert store.get("runs/r1/after") == b"written across the restart"
    assert store.get("runs/r1/before") == b"kept"  # what was there before is still there
    store.ping()
    store.close()


@pytest.mark.usefixtures("prefect_api")
def test_an_aci_job_without_a_store_is_pointed_at_azure_blob(capsys):
    """The validation error and the dry run of an ACI job with no store suggest Azure Blob,
    not S3 (a docker job is still pointed at S3 or Redis)."""
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import validate_job
    from flows.dry_run import main

    with pytest.raises(ZooidValueError, match=r"^store: .*target 'aci'.*use an Azure Blob store") as refused:
        validate_job(TrainJob(target="aci"), check_store=False)
    assert "S3" not in str(refused.value) and "zooid-azure-blob-store" in str(refused.value)
    assert main(["--param", "target=aci", "--param", "rent=false"]) == 2
    err = capsys.readouterr().err
    assert "Azure Blob store" in err and "S3" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ZooidValueError, match=r"S3 or Redis"):
        validate_job(TrainJob(target="docker"), check_store=False)


@pytest.mark.usefixtures("prefect_api")
def test_bootstrap_creates_the_aci_container_and_block(azurite, monkeypatch, capsys):
    """What `deployments.bootstrap --target aci --blob-container NAME` adds to the pool's setup."""
    from blocks.store_refs import open_store_ref
    from deployments.azure_blob import bootstrap_blob_store
    from deployments.bootstrap import main

    container = f"zooid-boot-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    for created in (True, False):  # the second run finds both and changes nothing
        done = bootstrap_blob_store(container)
        assert done == {"azure_blob_store": "zooid-azure-blob-store/zooid-aci", "url": f"az://{container}/zooid",
                        "container_created": created, "credentials_block": "zooid-azure-blob"}
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    with open_store_ref("block:zooid-azure-blob-store/zooid-aci") as store:  # workers open it by reference
        store.put("runs/b/k", b"v")
    raw = BlobServiceClient.from_connection_string(azurite.connection_string())
    assert raw.get_blob_client(container, "zooid/runs/b/k").download_blob().readall() == b"v"
    with pytest.raises(ZooidValueError, match="^blob_container: needs a storage account"):
        bootstrap_blob_store(container)
    assert main(["--target", "ecs", "--blob-container", container]) == 2
    assert capsys.readouterr().out.startswith("error: blob_container: ")
    # the whole command: the ACI pool (its template accepted by the API), then the container and block
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    fresh = f"zooid-cli-{uuid.uuid4().hex[:8]}"
    assert main(["--target", "aci", "--blob-container", fresh]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["work_pool"] == "zooid-aci" and out["url"] == f"az://{fresh}/zooid" and out["container_created"]

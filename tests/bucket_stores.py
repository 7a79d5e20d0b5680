"""The three kinds of store a prepared dataset lives in, for tests parametrized over them
("dir", "s3": the moto server, "azure": Azurite): an empty client, or a URL as a job names it."""
from __future__ import annotations

import uuid

from comm.store import Store
from comm.store_dir import DirectoryStore

KINDS = ["dir", "s3", "azure"]


def empty_store(kind: str, request, tmp_path, name: str = "data", prefix: str = "") -> Store:
    """A fresh, empty store of `kind` (a new bucket or container on the session's server),
    its keys under `prefix` there."""
    if kind == "dir":
        return DirectoryStore(tmp_path / "bucket")
    if kind == "s3":
        from comm.store_s3 import S3Store

        server = request.getfixturevalue("s3_server")
        return S3Store(server.create_bucket(f"{name}-{uuid.uuid4().hex[:12]}"), prefix, endpoint=server.endpoint)
    from comm.store_azure import AzureBlobStore

    server = request.getfixturevalue("azurite")
    return AzureBlobStore(server.create_container(f"{name}-{uuid.uuid4().hex[:12]}"), prefix,
                          connection_string=server.connection_string())


def bucket_url(kind: str, request, tmp_path, monkeypatch, name: str, prefix: str) -> str:
    """The URL of `prefix` in a fresh store of `kind`, as a job's `dataset` names it; Azure's
    account comes from the environment, as a worker on Azure has it."""
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        return f"s3://{server.create_bucket(f'{name}-{uuid.uuid4().hex[:10]}')}/{prefix}?endpoint={server.endpoint}"
    if kind == "azure":
        server = request.getfixturevalue("azurite")
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string())
        return f"az://{server.create_container(f'{name}-{uuid.uuid4().hex[:10]}')}/{prefix}"
    return (tmp_path / "bucket").as_uri()

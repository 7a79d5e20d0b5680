"""Open a store from a URL: `open_store(url)` picks one of the implementations.

The interface (`Store`, `StoreKeyError`, `check_key`) lives in `comm.store_base`; the
implementations (`store_dir`, `store_redis`, `store_s3`, `store_azure`) import it from there.
This module imports the directory store up front, and each other one (with its client library)
only when a URL asks for it. `Store` and `StoreKeyError` can still be imported from here.

- `file:///abs/path` or a plain path: a directory (the embedded default, `.zooid/store`)
- `redis://host:port/db`: Redis
- `s3://bucket/prefix` (endpoint from `?endpoint=...`, `ZOOID_S3_ENDPOINT` or
  `AWS_ENDPOINT_URL`): S3
- `az://container/prefix` (account from a block; else `?account_url=...` or
  `AZURE_STORAGE_CONNECTION_STRING`): Azure Blob Storage
"""
from __future__ import annotations

from urllib.parse import urlsplit

from comm.store_base import Store, StoreKeyError, check_key
from comm.store_dir import DirectoryStore
from core.errors import ZooidValueError

__all__ = ["Store", "StoreKeyError", "check_key", "open_store"]


def open_store(url: str, *, upload_bytes_per_s: float | None = None,
               download_bytes_per_s: float | None = None, s3_session=None,
               azure_account: dict | None = None) -> Store:
    """Open the store a URL names (see the module docstring).

    `upload_bytes_per_s` / `download_bytes_per_s` emulate a link of that bandwidth per
    direction (e.g. 70e6 for an AWS Lambda function); None leaves a direction unpaced.
    `s3_session`: the boto3 Session an S3 store uses (its credentials, from a block); None:
    boto3's default chain (a task role, the instance profile, the standard variables).
    `azure_account`: an Azure Blob store's account as client arguments (`connection_string`,
    or `credential` for the URL's `account_url`), from a block; None: the URL's conventions.
    """
    if not isinstance(url, str) or not url.strip():
        raise ZooidValueError("store", f"must be a store URL or a path, got {url!r}")
    rates = dict(upload_bytes_per_s=upload_bytes_per_s, download_bytes_per_s=download_bytes_per_s)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and url[1:2] == ":"):
        return DirectoryStore.from_url(url, **rates)
    # The other stores are imported here, when a URL asks for one: each pulls in its client
    # library (redis, boto3, azure-storage-blob), and a process using one store loads only that.
    if scheme in ("redis", "rediss", "unix"):
        from comm.store_redis import RedisStore  # redis: only for a redis:// store
        return RedisStore.from_url(url, **rates)
    if scheme == "s3":
        from comm.store_s3 import S3Store  # boto3: only for an s3:// store
        return S3Store.from_url(url, session=s3_session, **rates)
    if scheme == "az":
        from comm.store_azure import AzureBlobStore  # azure-storage-blob: only for an az:// store
        return AzureBlobStore.from_url(url, **(azure_account or {}), **rates)
    raise ZooidValueError(
        "store", f"unknown scheme {scheme!r} in {url!r}; use file://, redis://, s3:// or az://")

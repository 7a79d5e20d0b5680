"""The Azure Blob store: azure-storage-blob against Azure Storage or Azurite.

`az://container/prefix` puts every key under `prefix/` in one container of a storage
account. The account comes from the caller, as arguments: a connection string (what the
`zooid-azure-blob-store` block holds), or an account URL with a credential (a managed
identity, a service principal). A bare URL opened from the command line falls back to the
conventions the Azure SDK documents: `?account_url=https://<account>.blob.core.windows.net`
with `DefaultAzureCredential`, else the connection string in `AZURE_STORAGE_CONNECTION_STRING`
(read, never written).

A block blob becomes visible whole: a single Put Blob, or, above `single_put_bytes`, blocks
staged in parallel (`block_bytes` each, so a large checkpoint streams) and made visible at
once by Put Block List. A read of a value larger than one GET is pinned to the ETag of its
first range, so an overwrite in between is retried, never stitched.
"""
from __future__ import annotations

import os
import re
from urllib.parse import parse_qs, urlsplit

from azure.core.exceptions import AzureError, ResourceExistsError, ResourceModifiedError
from azure.storage.blob import BlobServiceClient, LinearRetry

from comm.store_base import Store
from core.errors import StoreError, ZooidValueError
from core.object_requests import (AZURE_BLOCK_BYTES, AZURE_SINGLE_GET_BYTES, AZURE_SINGLE_PUT_BYTES,
                                  azure_get_requests, azure_put_requests)

CONCURRENCY = 4
DELETE_BATCH = 256  # a blob batch takes at most 256 sub-requests
LIST_PAGE = 5000  # names per List Blobs page (the service's maximum and default)
RETRY_SECONDS = 20.0  # how long an operation keeps retrying an unreachable account (a restart)
CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
_SAS = re.compile(r"(?i)\b(sig|se|st|sp|sv|spr|srt|ss|skoid|sktid|skt|ske|sks|skv)=[^&\s'\"<]*")
_ACCOUNT_KEY = re.compile(r"(?i)AccountKey=[^;\s'\"]*")


def _redacted(text: str) -> str:
    """`text` without SAS query values or an AccountKey (error messages may echo a URL)."""
    return _ACCOUNT_KEY.sub("AccountKey=<redacted>", _SAS.sub(r"\1=<redacted>", text))


def _code(e: Exception) -> str:
    """The storage error code of a service error ('' for others)."""
    code = getattr(e, "error_code", None) or ""
    return str(getattr(code, "value", code))


def _reason(e: Exception) -> str:
    """` (<error code>): <first line>` of an Azure error, redacted."""
    code = f" ({_code(e)})" if _code(e) else ""
    return f"{code}: {_redacted(str(e).splitlines()[0] if str(e) else type(e).__name__)}"


def _client(connection_string: str | None, account_url: str | None, credential, *, retries: int,
            connect_s: float, read_s: float, single_put_bytes: int = AZURE_SINGLE_PUT_BYTES) -> BlobServiceClient:
    """A BlobServiceClient with short linear retries (`retries` x 0.5 s) and these timeouts."""
    options = dict(retry_policy=LinearRetry(backoff=0.5, random_jitter_range=0, retry_total=retries,
                                            retry_connect=retries, retry_read=retries, retry_status=retries),
                   connection_timeout=connect_s, read_timeout=read_s,
                   max_single_put_size=single_put_bytes, max_block_size=AZURE_BLOCK_BYTES,
                   max_single_get_size=AZURE_SINGLE_GET_BYTES, max_chunk_get_size=AZURE_BLOCK_BYTES)
    if connection_string:
        return BlobServiceClient.from_connection_string(connection_string, **options)
    return BlobServiceClient(account_url, credential=credential, **options)


class AzureBlobStore(Store):
    """Block blobs in one container below a prefix; large puts go as staged blocks."""

    poll_max_s = 0.1  # every poll is a billed request on real Azure

    def __init__(self, container: str, prefix: str = "", *, connection_string: str | None = None,
                 account_url: str | None = None, credential=None, url: str | None = None,
                 single_put_bytes: int = AZURE_SINGLE_PUT_BYTES, **rates):
        super().__init__(**rates)
        if not container:
            raise ZooidValueError("store", "an Azure Blob store needs a container: az://container/prefix")
        if not (connection_string or account_url):
            raise ZooidValueError("store", f"az://{container} needs a storage account: a zooid-azure-blob-store "
                                  f"block, ?account_url=https://<account>.blob.core.windows.net or "
                                  f"{CONNECTION_STRING_ENV}")
        if not (isinstance(single_put_bytes, int) and single_put_bytes > 0):
            raise ZooidValueError("single_put_bytes", f"must be a positive int, got {single_put_bytes!r}")
        self.container = container
        prefix = prefix.strip("/")
        self.prefix = prefix + "/" if prefix else ""
        self.url = url or f"az://{container}/{prefix}"
        self.single_put_bytes = single_put_bytes
        self._account = (connection_string, account_url, credential)
        try:
            self.client = _client(*self._account, retries=int(RETRY_SECONDS / 0.5), connect_s=2.0, read_s=60.0,
                                  single_put_bytes=single_put_bytes)
        except (ValueError, AzureError) as e:  # a malformed connection string or URL
            raise ZooidValueError("store", f"bad Azure account for {self.url}: {_redacted(str(e))}") from None
        self.blobs = self.client.get_container_client(container)
        self._ping_blobs = None  # made on first ping

    @classmethod
    def from_url(cls, url: str, *, connection_string: str | None = None, credential=None,
                 **rates) -> "AzureBlobStore":
        """Open `az://container/prefix[?account_url=URL]`; the account from the arguments,
        else `?account_url=` with `DefaultAzureCredential`, else AZURE_STORAGE_CONNECTION_STRING."""
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"account_url"}
        if unknown:
            raise ZooidValueError("store", f"unknown Azure Blob URL parameter(s) {sorted(unknown)} in {url!r}")
        account_url = query.get("account_url")
        if not connection_string and not account_url:
            connection_string = os.environ.get(CONNECTION_STRING_ENV) or None
        if account_url and not connection_string and credential is None:
            from azure.identity import DefaultAzureCredential

            credential = DefaultAzureCredential()
        return cls(parts.netloc, parts.path, connection_string=connection_string, account_url=account_url,
                   credential=credential, url=url, **rates)

    def _fail(self, what: str, key: str, e: Exception) -> StoreError:
        return StoreError(f"Azure Blob {what} of {key!r} in container {self.container!r} ({self.url}) "
                          f"failed{_reason(e)}")

    def _write(self, key: str, data: bytes) -> None:
        try:
            self.blobs.upload_blob(self.prefix + key, data, overwrite=True, max_concurrency=CONCURRENCY)
        except AzureError as e:
            raise self._fail("put", key, e) from e

    def _read(self, key: str) -> bytes | None:
        for _ in range(8):  # an overwrite between two ranges of one read: read it again
            try:
                return self.blobs.download_blob(self.prefix + key, max_concurrency=CONCURRENCY).readall()
            except ResourceModifiedError:
                continue
            except AzureError as e:
                if _code(e) == "BlobNotFound":
                    return None
                raise self._fail("get", key, e) from e
        raise StoreError(f"Azure Blob get of {key!r} in container {self.container!r} ({self.url}) failed: "
                         "the blob changed under every one of 8 reads")

    def _exists(self, key: str) -> bool:
        try:
            self.blobs.get_blob_client(self.prefix + key).get_blob_properties()
            return True
        except AzureError as e:
            if _code(e) == "BlobNotFound":
                return False
            raise self._fail("head", key, e) from e

    def _size(self, key: str) -> int | None:
        try:
            return int(self.blobs.get_blob_client(self.prefix + key).get_blob_properties().size)
        except AzureError as e:
            if _code(e) == "BlobNotFound":
                return None
            raise self._fail("head", key, e) from e

    def _read_range(self, key: str, start: int, length: int) -> bytes | None:
        try:
            return self.blobs.download_blob(self.prefix + key, offset=start, length=length).readall()
        except AzureError as e:
            if _code(e) == "BlobNotFound":
                return None
            if _code(e) == "InvalidRange":  # starts past the end
                return b""
            raise self._fail("get", key, e) from e

    def _names(self, prefix: str) -> list[str]:
        """Full blob names under `prefix`."""
        try:
            return list(self.blobs.list_blob_names(name_starts_with=self.prefix + prefix))
        except AzureError as e:
            raise self._fail("list", prefix, e) from e

    def _list(self, prefix: str) -> list[str]:
        return [name[len(self.prefix):] for name in self._names(prefix)]

    def _delete_prefix(self, prefix: str) -> int:
        names = self._names(prefix)  # collect first: deleting while listing would shift the pages
        count = 0
        for i in range(0, len(names), DELETE_BATCH):
            try:
                answers = self.blobs.delete_blobs(*names[i:i + DELETE_BATCH], raise_on_any_failure=False)
            except AzureError as e:
                raise self._fail("delete", prefix, e) from e
            failed = [a for a in answers if a.status_code not in (202, 404)]
            if failed:
                raise StoreError(f"Azure Blob delete under {prefix!r} in container {self.container!r} "
                                 f"({self.url}) failed for {len(failed)} blobs (HTTP {failed[0].status_code})")
            count += sum(a.status_code == 202 for a in answers)
        return count

    def _delete(self, key: str) -> None:
        try:
            self.blobs.delete_blob(self.prefix + key)
        except AzureError as e:
            if _code(e) != "BlobNotFound":
                raise self._fail("delete", key, e) from e

    # --- requests per operation (`Store.ops`): the Azure SDK's own arithmetic -------

    def _put_requests(self, nbytes: int) -> int:
        """One Put Blob; above `single_put_bytes`, one Put Block per block and Put Block List."""
        return azure_put_requests(nbytes, self.single_put_bytes)

    def _get_requests(self, nbytes: int) -> int:
        """One Get Blob for the first `AZURE_SINGLE_GET_BYTES`, then one per `AZURE_BLOCK_BYTES` range."""
        return azure_get_requests(nbytes)

    def _list_requests(self, keys: int) -> int:
        """One List Blobs per page of up to 5,000 names (an empty listing is one)."""
        return max(1, -(-keys // LIST_PAGE))

    def _delete_requests(self, keys: int) -> int:
        """One Blob Batch per `DELETE_BATCH` blobs."""
        return -(-keys // DELETE_BATCH)

    def create_container(self) -> bool:
        """Create the container; True when it was created, False when it was there already."""
        try:
            self.blobs.create_container()
            return True
        except ResourceExistsError:
            return False
        except AzureError as e:
            raise StoreError(f"Azure Blob container {self.container!r} could not be created{_reason(e)}") from e

    def ping(self) -> None:
        """Raise StoreError within about two seconds unless the container answers."""
        if self._ping_blobs is None:  # one attempt with short timeouts
            client = _client(*self._account, retries=0, connect_s=1.0, read_s=1.0)
            self._ping_blobs = client.get_container_client(self.container)
        try:
            self._ping_blobs.get_container_properties(timeout=1)
        except AzureError as e:
            raise StoreError(f"Azure Blob container {self.container!r} at {self.client.url} "
                             f"unreachable{_reason(e)}") from e

    def close(self) -> None:
        """Close the HTTP connection pools."""
        self.client.close()
        if self._ping_blobs is not None:
            self._ping_blobs.close()

"""The S3 store: boto3 against AWS or any S3-compatible endpoint (moto, MinIO).

`s3://bucket/prefix` puts every key under `prefix/`. The endpoint comes from the URL
query (`?endpoint=http://127.0.0.1:9000`), else `ZOOID_S3_ENDPOINT`, else
`AWS_ENDPOINT_URL`, else AWS itself; `?region=` sets the region. A single PutObject is
atomic in S3 (readers see the old object or the new one), and so is a multipart upload,
which becomes visible only at CompleteMultipartUpload; large values go multipart through
boto3's transfer manager so parts upload in parallel.
"""
from __future__ import annotations

import hashlib
import io
import os
import threading
from urllib.parse import parse_qs, urlsplit

import boto3
import botocore.exceptions
import botocore.loaders
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from comm.store_base import Store
from core.errors import StoreError, ZooidValueError
from core.object_requests import S3_MULTIPART_CHUNK, S3_MULTIPART_THRESHOLD, s3_put_requests

LIST_PAGE = 1000  # keys per ListObjectsV2 page (S3's maximum and default)
_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


_LOADER = None


def _with_shared_loader(session):
    """`session` reading botocore's data files (the S3 model, the endpoint rules: megabytes of
    JSON) through one loader per process, which keeps what it parsed: a client then costs
    milliseconds, not the 0.3 s of CPU a fresh session spends parsing them again. Credentials
    stay the session's own."""
    global _LOADER
    if _LOADER is None:
        _LOADER = botocore.loaders.create_loader()
    session._session.register_component("data_loader", _LOADER)
    return session


_SHARED: dict[tuple, object] = {}
"""This process's boto3 Sessions by credentials and its S3 clients by session, endpoint and region
(`shared_session`, `_s3_client`)."""
_SHARED_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_SHARED.clear)  # a forked worker opens its own connections


def shared_session(access_key_id: str | None = None, secret_access_key: str | None = None,
                   region_name: str | None = None):
    """One boto3 Session per process for each set of credentials (none: boto3's chain), and one
    S3 client per session, endpoint and region (`S3Store`): a coordinator opens its durable
    store for each checkpoint, ledger and history it writes, and a new Session and client cost
    about 0.1 s of CPU each time (measured: 4 CPU-seconds of a 10-epoch run's coordinator).
    Sessions are made and clients taken from them under one lock (a Session is not
    thread-safe; its clients are). The secret is kept by the Session only; the cache keys on
    its digest."""
    digest = hashlib.sha256((secret_access_key or "").encode()).hexdigest()
    key = ("session", access_key_id or None, digest, region_name or None)
    with _SHARED_LOCK:
        session = _SHARED.get(key)
        if session is None:
            session = _SHARED[key] = _with_shared_loader(boto3.session.Session(
                aws_access_key_id=access_key_id or None, aws_secret_access_key=secret_access_key or None,
                region_name=region_name or None))
        return session


def _is_shared(session) -> bool:
    return any(session is s for s in list(_SHARED.values()))


def _s3_client(session, endpoint: str | None, region: str):
    """An S3 client of `session`: the process's one for a shared session (`shared_session`), else new."""
    config = Config(connect_timeout=2, read_timeout=60, max_pool_connections=32,
                    retries={"mode": "standard", "total_max_attempts": 4})
    if not _is_shared(session):
        return session.client("s3", endpoint_url=endpoint, region_name=region, config=config)
    key = ("client", id(session), endpoint, region)
    with _SHARED_LOCK:
        client = _SHARED.get(key)
        if client is None:
            client = _SHARED[key] = session.client("s3", endpoint_url=endpoint, region_name=region, config=config)
        return client


def _code(e: Exception) -> str:
    """The S3 error code of a ClientError ('' for other errors)."""
    return getattr(e, "response", {}).get("Error", {}).get("Code", "")


class S3Store(Store):
    """Objects in one bucket below a prefix; puts are single or multipart uploads."""

    poll_max_s = 0.1  # every poll is a billed request on real S3

    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 region: str | None = None, url: str | None = None,
                 multipart_threshold: int = S3_MULTIPART_THRESHOLD, session=None, **rates):
        super().__init__(**rates)
        if not bucket:
            raise ZooidValueError("store", "an S3 store needs a bucket: s3://bucket/prefix")
        self.bucket = bucket
        prefix = prefix.strip("/")
        self.prefix = prefix + "/" if prefix else ""
        self.endpoint = endpoint or os.environ.get("ZOOID_S3_ENDPOINT") or os.environ.get(
            "AWS_ENDPOINT_URL") or None
        self.region = (region or (session.region_name if session is not None else None)
                       or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
        # A URL that reopens this very store, endpoint included, for workers elsewhere.
        self.url = url or f"s3://{bucket}/{prefix}" + (f"?endpoint={endpoint}" if endpoint else "")
        # credentials: the caller's session, else boto3's chain
        session = _with_shared_loader(session) if session is not None else shared_session()
        self.client = _s3_client(session, self.endpoint, self.region)
        self._session = session
        self._ping_client = None  # made on first ping
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                       multipart_chunksize=S3_MULTIPART_CHUNK, max_concurrency=4)

    @classmethod
    def from_url(cls, url: str, session=None, **rates) -> "S3Store":
        """Open `s3://bucket/prefix[?endpoint=URL&region=R]`."""
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"endpoint", "region"}
        if unknown:
            raise ZooidValueError("store", f"unknown S3 URL parameter(s) {sorted(unknown)} in {url!r}")
        return cls(parts.netloc, parts.path, endpoint=query.get("endpoint"),
                   region=query.get("region"), url=url, session=session, **rates)

    def _fail(self, what: str, key: str, e: Exception) -> StoreError:
        return StoreError(f"S3 {what} of {key!r} in {self.url} failed: {e}")

    def _write(self, key: str, data: bytes) -> None:
        try:
            if len(data) < self.transfer.multipart_threshold:
                self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)
            else:
                self.client.upload_fileobj(io.BytesIO(data), self.bucket, self.prefix + key,
                                           Config=self.transfer)
        except _ERRORS as e:
            raise self._fail("put", key, e) from e

    def _read(self, key: str) -> bytes | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            return response["Body"].read()
        except botocore.exceptions.ClientError as e:
            if _code(e) in ("NoSuchKey", "404"):
                return None
            raise self._fail("get", key, e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail("get", key, e) from e

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return True
        except botocore.exceptions.ClientError as e:
            if _code(e) in ("NoSuchKey", "404", "NotFound"):
                return False
            raise self._fail("head", key, e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail("head", key, e) from e

    def _size(self, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)["ContentLength"])
        except botocore.exceptions.ClientError as e:
            if _code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._fail("head", key, e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail("head", key, e) from e

    def _read_range(self, key: str, start: int, length: int) -> bytes | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key,
                                              Range=f"bytes={start}-{start + length - 1}")
            return response["Body"].read()
        except botocore.exceptions.ClientError as e:
            if _code(e) in ("NoSuchKey", "404"):
                return None
            if _code(e) in ("InvalidRange", "416"):  # starts past the end
                return b""
            raise self._fail("get", key, e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail("get", key, e) from e

    def _pages(self, prefix: str):
        """Yield lists of full object keys under `prefix`, one list per page of up to 1000."""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                yield [obj["Key"] for obj in page.get("Contents", [])]
        except _ERRORS as e:
            raise self._fail("list", prefix, e) from e

    def _list(self, prefix: str) -> list[str]:
        return [k[len(self.prefix):] for page in self._pages(prefix) for k in page]

    def _delete_prefix(self, prefix: str) -> int:
        count = 0
        # Collect first: deleting while paginating would shift the pages under us.
        pages = list(self._pages(prefix))
        for page in pages:
            if not page:
                continue
            try:
                response = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in page], "Quiet": False})
            except _ERRORS as e:
                raise self._fail("delete", prefix, e) from e
            if response.get("Errors"):
                raise StoreError(f"S3 delete under {prefix!r} in {self.url} failed for "
                                 f"{len(response['Errors'])} keys: {response['Errors'][0]}")
            count += len(response.get("Deleted", []))
        return count

    def _delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)
        except _ERRORS as e:
            raise self._fail("delete", key, e) from e

    # --- requests per operation (`Store.ops`): S3's own arithmetic ------------------

    def _put_requests(self, nbytes: int) -> int:
        """One PutObject; a multipart upload is CreateMultipartUpload, one UploadPart per
        chunk and CompleteMultipartUpload."""
        return s3_put_requests(nbytes, self.transfer.multipart_threshold, self.transfer.multipart_chunksize)

    def _list_requests(self, keys: int) -> int:
        """One ListObjectsV2 per page of up to 1,000 keys (an empty listing is one)."""
        return max(1, -(-keys // LIST_PAGE))

    def _delete_requests(self, keys: int) -> int:
        """One DeleteObjects per listed page."""
        return -(-keys // LIST_PAGE)

    def ping(self) -> None:
        """Raise StoreError within about two seconds unless the bucket is reachable."""
        if self._ping_client is None:
            # One attempt with short timeouts, so an unreachable store answers in ~2 s.
            self._ping_client = self._session.client(
                "s3", endpoint_url=self.endpoint, region_name=self.region,
                config=Config(connect_timeout=1, read_timeout=1,
                              retries={"mode": "standard", "total_max_attempts": 1}))
        try:
            self._ping_client.head_bucket(Bucket=self.bucket)
        except _ERRORS as e:
            raise StoreError(f"S3 bucket {self.bucket!r} at "
                             f"{self.endpoint or 'AWS'} unreachable: {e}") from e

    def close(self) -> None:
        """Close the HTTP connection pools (a shared session's client stays open for the next store)."""
        if not _is_shared(self._session):
            self.client.close()
        if self._ping_client is not None:
            self._ping_client.close()

"""The `Zooid Store` block (a store by URL, with its secrets beside it) and `open_store_ref`,
the one opener of every store reference: a URL or `block:<type slug>/<name>`.

`ZooidStore` is the `StoreBlock` (`blocks.store_block`) for any store `comm.store.open_store`
opens by URL: a directory, Redis or S3. It holds the URL and the secrets (a Redis password,
AWS keys) as `SecretStr`. The URL is saved under the field name `url`, as blocks saved before
`StoreBlock` have it; in Python it is `location`, because `url()` is the interface's
safe-to-log URL.
"""
from __future__ import annotations

from typing import Optional
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, SecretStr

from blocks.store_block import BLOCK_PREFIX, DEFAULT_BLOCK_TYPE, StoreBlock, parse_block_ref
from comm.store import open_store
from core.errors import ZooidValueError


class ZooidStore(StoreBlock):
    """A directory, Redis or S3 store for one or more training runs."""

    _block_type_name = "Zooid Store"
    _block_type_slug = DEFAULT_BLOCK_TYPE
    _description = "Where Zooid keeps tensors in flight, dataset subsets, checkpoints and ledgers."

    location: str = Field(..., alias="url", title="URL",
                          description="file:///path, redis://host:port/db or s3://bucket/prefix.")
    password: Optional[SecretStr] = Field(None, title="Redis password")
    aws_access_key_id: Optional[str] = Field(None, title="AWS access key id")
    aws_secret_access_key: Optional[SecretStr] = Field(None, title="AWS secret access key")
    region_name: Optional[str] = Field(None, title="AWS region")
    endpoint_url: Optional[str] = Field(None, title="S3 endpoint URL", description="For S3-compatible services; empty for AWS.")

    def _is_s3(self) -> bool:
        return self.location.startswith("s3://")

    def url(self) -> str:
        """The store's URL without a password (an S3 one with `endpoint=` when it has one)."""
        parts = urlsplit(self.location)
        url = self.location
        if "@" in parts.netloc:
            user = f"{parts.username}@" if parts.username else ""
            url = urlunsplit(parts._replace(netloc=user + parts.netloc.rsplit("@", 1)[-1]))
        if self._is_s3() and self.endpoint_url and "endpoint=" not in url:
            url += ("&" if "?" in url else "?") + f"endpoint={quote(self.endpoint_url, safe=':/')}"
        return url

    def _url_with_password(self) -> str:
        """The Redis URL with the block's password filled in (never log this)."""
        if self.password is not None and self.location.startswith(("redis://", "rediss://")):
            parts = urlsplit(self.location)
            host = parts.netloc.rsplit("@", 1)[-1]
            netloc = f":{quote(self.password.get_secret_value(), safe='')}@{host}"
            return urlunsplit(parts._replace(netloc=netloc))
        return self.location

    def worker_environment(self) -> dict[str, str]:
        """The AWS region of an S3 store when the block names one (its keys stay in the block)."""
        return {"AWS_DEFAULT_REGION": self.region_name} if self._is_s3() and self.region_name else {}

    def open(self):
        """Open the store this block describes; an S3 store gets the block's keys through a boto3
        Session of its own keys (`comm.store_s3.shared_session`; never the process environment)."""
        if self._is_s3():
            from comm.store_s3 import shared_session  # boto3: only when the block is an S3 store

            session = shared_session(self.aws_access_key_id, (self.aws_secret_access_key.get_secret_value()
                                                              if self.aws_secret_access_key is not None else None),
                                     self.region_name)
            return open_store(self.url(), s3_session=session)
        return open_store(self._url_with_password())


def store_block_types() -> tuple[type[StoreBlock], ...]:
    """Every store block type (`load_store_block` loads a saved one by its own class)."""
    # Imported here, not at the top: prefect-aws, prefect-redis and prefect-azure (with boto3,
    # redis and the Azure SDK, about 0.4 s each) load only when a cloud store block is named.
    from blocks.cloud import ZooidRedisStore, ZooidS3Store  # prefect-aws, prefect-redis: only when named
    from blocks.store_block_azure import ZooidAzureBlobStore  # prefect-azure: only when named

    return ZooidStore, ZooidS3Store, ZooidRedisStore, ZooidAzureBlobStore


def is_store_url(value: str) -> bool:
    """Whether `value` is a URL (or path) rather than a block name or reference."""
    return "://" in value or value.startswith(("/", ".")) or value == ""


def load_store_block(ref: str) -> StoreBlock:
    """The saved store block `block:<type slug>/<name>` (or the older `block:<name>`) names,
    loaded from the Prefect API by its own class. (Prefect's `Block.load` looks the class up by
    the slug, and first imports every installed Prefect collection, prefect-aws, -azure, -docker,
    -kubernetes and -redis with their SDKs: 4 to 5 CPU-seconds in each coordinator and worker
    that opened a block, measured.)"""
    slug, name = parse_block_ref(ref)
    # the cloud blocks' modules (prefect-aws, prefect-redis, prefect-azure) only when named
    types = (ZooidStore,) if slug == DEFAULT_BLOCK_TYPE else store_block_types()
    block_type = next((t for t in types if t.get_block_type_slug() == slug), None)
    if block_type is None:
        raise ZooidValueError("store", f"block {slug}/{name} is not a Zooid store block (its type is none of "
                              f"{', '.join(t.get_block_type_slug() for t in store_block_types())})")
    return block_type.load(name)


def open_store_ref(ref: str):
    """Open a store from a URL or a store block reference (what workers receive)."""
    if ref.startswith(BLOCK_PREFIX):
        return load_store_block(ref).open()
    return open_store(ref)

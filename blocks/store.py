"""The `Zooid Store` block: where tensors, data subsets, checkpoints and ledgers live.

A block holds the URL and the secrets (a Redis password, AWS keys) as `SecretStr`, so a job
names the block and no secret ever travels as a flow parameter, a log line or an artifact.
Workers receive `block:<name>` and load the block themselves.
"""
from __future__ import annotations

from typing import Optional
from urllib.parse import quote, urlsplit, urlunsplit

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

BLOCK_PREFIX = "block:"


class ZooidStore(Block):
    """A directory, Redis or S3 store for one or more training runs."""

    _block_type_name = "Zooid Store"
    _block_type_slug = "zooid-store"
    _description = "Where Zooid keeps tensors in flight, dataset subsets, checkpoints and ledgers."

    url: str = Field(..., title="URL", description="file:///path, redis://host:port/db or s3://bucket/prefix.")
    password: Optional[SecretStr] = Field(None, title="Redis password")
    aws_access_key_id: Optional[str] = Field(None, title="AWS access key id")
    aws_secret_access_key: Optional[SecretStr] = Field(None, title="AWS secret access key")
    region_name: Optional[str] = Field(None, title="AWS region")
    endpoint_url: Optional[str] = Field(None, title="S3 endpoint URL", description="For S3-compatible services; empty for AWS.")

    def resolved_url(self) -> str:
        """The URL with the Redis password filled in (never log this)."""
        if self.password is not None and self.url.startswith(("redis://", "rediss://")):
            parts = urlsplit(self.url)
            host = parts.netloc.rsplit("@", 1)[-1]
            netloc = f":{quote(self.password.get_secret_value(), safe='')}@{host}"
            return urlunsplit(parts._replace(netloc=netloc))
        return self.url

    def open(self):
        """Open the store this block describes; an S3 store gets the block's keys through its
        own boto3 Session (never the process environment)."""
        from comm.store import open_store

        if self.url.startswith("s3://"):
            import boto3

            session = boto3.session.Session(
                aws_access_key_id=self.aws_access_key_id or None,
                aws_secret_access_key=(self.aws_secret_access_key.get_secret_value()
                                       if self.aws_secret_access_key is not None else None),
                region_name=self.region_name or None)
            url = self.resolved_url()
            if self.endpoint_url and "endpoint=" not in url:
                url += ("&" if "?" in url else "?") + f"endpoint={quote(self.endpoint_url, safe=':/')}"
            return open_store(url, s3_session=session)
        return open_store(self.resolved_url())


def is_store_url(value: str) -> bool:
    """Whether `value` is a URL (or path) rather than a block name."""
    return "://" in value or value.startswith(("/", ".")) or value == ""


def open_store_ref(ref: str):
    """Open a store from a URL or `block:<name>` (what workers receive)."""
    from comm.store import open_store

    if ref.startswith(BLOCK_PREFIX):
        if "/" in ref[len(BLOCK_PREFIX):]:  # block:<type slug>/<name>: an S3 or Redis store block
            from blocks.cloud import open_block_store

            return open_block_store(ref)
        return ZooidStore.load(ref[len(BLOCK_PREFIX):]).open()
    return open_store(ref)

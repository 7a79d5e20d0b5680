"""Cloud store blocks, composed from the integrations' own blocks.

- `ZooidS3Store` holds a prefect-aws `S3Bucket` (which holds `AwsCredentials`) and a prefix.
- `ZooidRedisStore` holds a prefect-redis `RedisDatabase` (password as `SecretStr`), e.g.
  Azure Cache for Redis or ElastiCache.

Secrets never travel as parameters, job variables or log lines: a worker receives
`block:<type slug>/<name>` (`worker_store_ref`) and loads the block itself from the Prefect
API, and `worker_environment` holds only what is not secret (region, endpoint). In the cloud,
prefer no keys at all: an ECS task role or an ACI managed identity.

Pointing a work pool at the cloud account (`bootstrap_cloud`) lives in `deployments.bootstrap`
(`python -m deployments.bootstrap --target ecs --cluster ...`): deployments import blocks,
never the other way round.
"""
from __future__ import annotations

from typing import Optional
from urllib.parse import quote

from prefect.blocks.core import Block
from prefect_aws import AwsCredentials
from prefect_aws.s3 import S3Bucket
from prefect_redis.blocks import RedisDatabase
from pydantic import Field

BLOCK_REF = "block:"


class ZooidS3Store(Block):
    """Tensors, subsets, checkpoints and ledgers in an S3 bucket (FuncPipe's storage-based exchange)."""

    _block_type_name = "Zooid S3 Store"
    _block_type_slug = "zooid-s3-store"
    _description = "An S3 bucket (with its AWS credentials block) and a key prefix for Zooid runs."

    bucket: S3Bucket = Field(..., title="S3 bucket", description="A prefect-aws S3 Bucket block; its credentials are used.")
    prefix: str = Field("zooid", title="Key prefix", description="Every key lives below this prefix.")

    def _endpoint(self) -> Optional[str]:
        return self.bucket.credentials.aws_client_parameters.endpoint_url

    def url(self) -> str:
        """`s3://bucket/prefix[?endpoint=...]`: no secret in it."""
        endpoint = self._endpoint()
        query = f"?endpoint={quote(endpoint, safe=':/')}" if endpoint else ""
        return f"s3://{self.bucket.bucket_name}/{self.prefix.strip('/')}{query}"

    def worker_environment(self) -> dict[str, str]:
        """Environment for workers: the region only (keys come from the block or the task role)."""
        region = self.bucket.credentials.region_name
        return {"AWS_DEFAULT_REGION": region} if region else {}

    def open(self):
        """Open the store in this process, with the credentials block's keys when it has any."""
        from comm.store import open_store

        creds = self.bucket.credentials
        if isinstance(creds, AwsCredentials):  # the block's keys reach boto3 as arguments, never the environment
            return open_store(self.url(), s3_session=creds.get_boto3_session())
        return open_store(self.url())


class ZooidRedisStore(Block):
    """Scratch tensors in Redis (KubeML's model averaging through Redis)."""

    _block_type_name = "Zooid Redis Store"
    _block_type_slug = "zooid-redis-store"
    _description = "A prefect-redis Redis Database block used as Zooid's store."

    database: RedisDatabase = Field(..., title="Redis database", description="Host, port, db and password (secret).")

    def url(self) -> str:
        """`redis[s]://host:port/db` without the password (safe to log)."""
        scheme = "rediss" if self.database.ssl else "redis"
        return f"{scheme}://{self.database.host}:{self.database.port}/{self.database.db}"

    def worker_environment(self) -> dict[str, str]:
        """Nothing: the password stays in the block."""
        return {}

    def open(self):
        """Open the store with the password filled in (the URL with it is never returned or logged)."""
        from comm.store import open_store

        db = self.database
        if db.connection_url is not None:
            return open_store(db.connection_url.get_secret_value())
        auth = ""
        if db.password is not None:
            user = db.username.get_secret_value() if db.username is not None else ""
            auth = f"{quote(user, safe='')}:{quote(db.password.get_secret_value(), safe='')}@"
        scheme = "rediss" if db.ssl else "redis"
        return open_store(f"{scheme}://{auth}{db.host}:{db.port}/{db.db}")


STORE_BLOCKS = (ZooidS3Store, ZooidRedisStore)


def worker_store_ref(block: Block) -> str:
    """What a worker receives for a saved store block: `block:<type slug>/<name>`."""
    name = getattr(block, "_block_document_name", None)
    if not name:
        raise ValueError("store: save the block before handing it to workers (it has no name)")
    return f"{BLOCK_REF}{block.get_block_type_slug()}/{name}"


def open_block_store(ref: str):
    """Open `block:<type slug>/<name>` (any Zooid store block) in a worker."""
    if not ref.startswith(BLOCK_REF) or "/" not in ref:
        raise ValueError(f"store: expected block:<type slug>/<name>, got {ref!r}")
    for cls in STORE_BLOCKS:  # register the types so Block.load can build them
        cls.get_block_type_slug()
    return Block.load(ref[len(BLOCK_REF):]).open()


if __name__ == "__main__":
    raise SystemExit("python -m blocks.cloud moved: run `python -m deployments.bootstrap --cloud --target "
                     "ecs|aci|k8s [--cluster ...] [--resource-group ... --subscription-id ...] [--namespace ...]`")

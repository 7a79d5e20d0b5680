"""Cloud store blocks, composed from the integrations' own blocks; both are `StoreBlock`s
(`blocks.store_block`: `url()`, `open()`, `worker_environment()`, `ref()`).

- `ZooidS3Store` holds a prefect-aws `S3Bucket` (which holds `AwsCredentials`) and a prefix.
- `ZooidRedisStore` holds a prefect-redis `RedisDatabase` (password as `SecretStr`), e.g.
  Azure Cache for Redis or ElastiCache.

Secrets never travel as parameters, job variables or log lines: a worker receives
`block:<type slug>/<name>` (`StoreBlock.ref`) and opens it with `blocks.store_refs.open_store_ref`,
which loads the block itself from the Prefect API; `worker_environment` holds only what is
not secret (region). In the cloud, prefer no keys at all: an ECS task role or an ACI managed
identity.

Pointing a work pool at the cloud account (`bootstrap_cloud`) lives in `deployments.bootstrap`
(`python -m deployments.bootstrap --target ecs --cluster ...`): deployments import blocks,
never the other way round.
"""
from __future__ import annotations

from typing import Optional
from urllib.parse import quote

from prefect_aws import AwsCredentials
from prefect_aws.s3 import S3Bucket
from prefect_redis.blocks import RedisDatabase
from pydantic import Field

from blocks.store_block import StoreBlock
from comm.store import open_store


class ZooidS3Store(StoreBlock):
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
        creds = self.bucket.credentials
        if isinstance(creds, AwsCredentials):  # the block's keys reach boto3 as arguments, never the environment
            return open_store(self.url(), s3_session=creds.get_boto3_session())
        return open_store(self.url())


class ZooidRedisStore(StoreBlock):
    """Scratch tensors in Redis (KubeML's model averaging through Redis)."""

    _block_type_name = "Zooid Redis Store"
    _block_type_slug = "zooid-redis-store"
    _description = "A prefect-redis Redis Database block used as Zooid's store."

    database: RedisDatabase = Field(..., title="Redis database", description="Host, port, db and password (secret).")

    def url(self) -> str:
        """`redis[s]://host:port/db` without the password (safe to log)."""
        scheme = "rediss" if self.database.ssl else "redis"
        return f"{scheme}://{self.database.host}:{self.database.port}/{self.database.db}"

    def open(self):
        """Open the store with the password filled in (the URL with it is never returned or logged)."""
        db = self.database
        if db.connection_url is not None:
            return open_store(db.connection_url.get_secret_value())
        auth = ""
        if db.password is not None:
            user = db.username.get_secret_value() if db.username is not None else ""
            auth = f"{quote(user, safe='')}:{quote(db.password.get_secret_value(), safe='')}@"
        scheme = "rediss" if db.ssl else "redis"
        return open_store(f"{scheme}://{auth}{db.host}:{db.port}/{db.db}")


if __name__ == "__main__":
    raise SystemExit("python -m blocks.cloud moved: run `python -m deployments.bootstrap --cloud --target "
                     "ecs|aci|k8s [--cluster ...] [--resource-group ... --subscription-id ...] [--namespace ...]`")

"""Cloud store blocks, composed from the integrations' own blocks, and the cloud bootstrap.

- `ZooidS3Store` holds a prefect-aws `S3Bucket` (which holds `AwsCredentials`) and a prefix.
- `ZooidRedisStore` holds a prefect-redis `RedisDatabase` (password as `SecretStr`), e.g.
  Azure Cache for Redis or ElastiCache.

Secrets never travel as parameters, job variables or log lines: a worker receives
`block:<type slug>/<name>` (`worker_store_ref`) and loads the block itself from the Prefect
API, and `worker_environment` holds only what is not secret (region, endpoint). In the cloud,
prefer no keys at all: an ECS task role or an ACI managed identity.

`bootstrap_cloud(target, ...)` runs the lead's `deployments.bootstrap.bootstrap(target)` and
then points the pool's template defaults at the cloud account: credentials blocks by
reference (`{"$ref": {"block_document_id": ...}}`), cluster, resource group, namespace.
"""
from __future__ import annotations

import os
from typing import Any, Optional
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
        from training.store import open_store

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
        from training.store import open_store

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


def block_reference(block_document_id) -> dict:
    """A job-template default that points at a saved block (how the UI stores one)."""
    return {"$ref": {"block_document_id": str(block_document_id)}}


def with_variable_defaults(base_job_template: dict, defaults: dict[str, Any]) -> dict:
    """A copy of a base job template with new defaults for some variables; unknown names are an error."""
    import copy

    out = copy.deepcopy(base_job_template)
    props = out["variables"]["properties"]
    unknown = sorted(set(defaults) - set(props))
    if unknown:
        raise ValueError(f"defaults: not variables of this template: {', '.join(unknown)}")
    for name, value in defaults.items():
        if value is not None:
            props[name]["default"] = value
    return out


def _credentials_block(target: str):
    """A credentials block from the standard environment variables, or None when they are unset."""
    if target == "ecs" and os.environ.get("AWS_ACCESS_KEY_ID"):
        return "zooid-aws", AwsCredentials(aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                                           aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
                                           region_name=os.environ.get("AWS_DEFAULT_REGION"))
    if target == "aci" and os.environ.get("AZURE_CLIENT_ID"):
        from prefect_azure import AzureContainerInstanceCredentials

        return "zooid-azure", AzureContainerInstanceCredentials(
            client_id=os.environ["AZURE_CLIENT_ID"], tenant_id=os.environ.get("AZURE_TENANT_ID"),
            client_secret=os.environ.get("AZURE_CLIENT_SECRET"))
    return None


def bootstrap_cloud(target: str, *, cluster: str | None = None, resource_group: str | None = None,
                    subscription_id: str | None = None, namespace: str | None = None,
                    paid_worker_limit: int = 16) -> dict:
    """Bootstrap a cloud target (`ecs`, `aci`, `k8s`) idempotently; returns what was set, no secrets.

    The credentials block is created from AWS_* / AZURE_* variables when they are set (else the
    workers use their role or identity), and the pool's template defaults then reference it.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    from deployments.bootstrap import bootstrap

    if target not in ("ecs", "aci", "k8s"):
        raise ValueError(f"target: must be ecs, aci or k8s, got {target!r}")
    if target == "aci" and not (resource_group and subscription_id):
        raise ValueError("resource_group: ACI needs resource_group and subscription_id")
    done = bootstrap(target, paid_worker_limit)
    for cls in STORE_BLOCKS:
        cls.register_type_and_schema()
    defaults: dict[str, Any] = {"cluster": cluster} if target == "ecs" else {}
    if target == "aci":
        defaults.update(resource_group_name=resource_group, subscription_id=subscription_id)
    if target == "k8s":
        defaults["namespace"] = namespace
    creds = _credentials_block(target)
    if creds is not None:
        name, block = creds
        block_id = block.save(name, overwrite=True)
        defaults["aws_credentials" if target == "ecs" else "aci_credentials"] = block_reference(block_id)
        done["credentials_block"] = name
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(done["work_pool"])
        client.update_work_pool(done["work_pool"], WorkPoolUpdate(
            base_job_template=with_variable_defaults(pool.base_job_template, defaults)))
    done["defaults"] = sorted(k for k, v in defaults.items() if v is not None)
    return done


def main(argv: list[str] | None = None) -> int:
    """`python -m blocks.cloud --target ecs|aci|k8s [...]`: `bootstrap_cloud` from a shell."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m blocks.cloud", description=bootstrap_cloud.__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, choices=["ecs", "aci", "k8s"])
    parser.add_argument("--cluster", help="ECS cluster name or ARN")
    parser.add_argument("--resource-group", help="Azure resource group (ACI)")
    parser.add_argument("--subscription-id", help="Azure subscription id (ACI)")
    parser.add_argument("--namespace", help="Kubernetes namespace")
    parser.add_argument("--paid-worker-limit", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        done = bootstrap_cloud(args.target, cluster=args.cluster, resource_group=args.resource_group,
                               subscription_id=args.subscription_id, namespace=args.namespace,
                               paid_worker_limit=args.paid_worker_limit)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

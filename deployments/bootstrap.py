"""Create or update what a target needs on the Prefect API, idempotently.

`python -m deployments.bootstrap --target local|docker|ecs|aci|k8s [--image REF]`:
- the work pool (`zooid-<target>`), with the base job template from
  `deployments/templates/<type>.json` when there is one, else the worker type's default;
- the Zooid block types (Store, Compute Target) and a Compute Target block for the target;
- a global concurrency limit `zooid-paid-workers` that caps paid workers across runs;
- `--image`: the pool's default worker image (the `docker` target's is the image `make image`
  built on the engine); `--env NAME=VALUE`: the pool's default environment for every worker
  (the launcher keeps it under each worker's own variables).
Running it twice changes nothing the second time.

`python -m deployments.bootstrap --target aci --blob-container NAME [--blob-prefix P]
[--blob-credentials BLOCK | --blob-account-url URL]` also creates that Azure Blob container and
the `zooid-azure-blob-store/zooid-aci` block on it (`deployments.azure_blob`), the store an ACI
job names.

`python -m deployments.bootstrap --target ecs|aci|k8s --cloud [--cluster ...]
[--resource-group ... --subscription-id ...] [--namespace ...]` (any of those options implies
`--cloud`) then runs `bootstrap_cloud`: it also registers the cloud store blocks and points the
pool's template defaults at the cloud account: credentials blocks by reference
(`{"$ref": {"block_document_id": ...}}`), cluster, resource group, namespace.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

from blocks.compute import BUILTIN, ComputeTarget
from blocks.store_refs import ZooidStore, store_block_types
from clouds.registry import PROVIDERS, provider_of_builtin
from core.errors import StoreError
from core.kinds import CLOUD_ACCOUNT_TARGETS
from deployments.azure_blob import bootstrap_blob_store

POOL_TYPES = {provider.kind.builtin: provider.pool_type() for provider in PROVIDERS.values()}
"""Built-in target name -> its pool's type, one per provider in `clouds.registry.PROVIDERS`."""
TEMPLATES = Path(__file__).with_name("templates")
from coordinator.workers.launchers import PAID_WORKERS_LIMIT as CONCURRENCY_LIMIT

PAID_WORKERS = 16
"""Workers the paid-workers limit lets run at once, unless `--paid-worker-limit` says otherwise."""


def base_job_template(pool_type: str) -> dict:
    """The pool's base job template: ours where we ship one, else the worker's default."""
    ours = TEMPLATES / f"{pool_type}.json"
    if ours.exists():
        return json.loads(ours.read_text())
    from prefect.workers.base import BaseWorker

    worker_cls = BaseWorker.get_worker_class_from_type(pool_type)
    if worker_cls is None:
        raise ValueError(f"target: no Prefect worker installed for pool type {pool_type!r}")
    return worker_cls.get_default_base_job_template()


def ensure_pool(client, name: str, pool_type: str, defaults: dict[str, Any] | None = None) -> str:
    """Create the work pool or update its template (with `defaults` for some of its variables);
    return 'created' or 'updated'."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    template = base_job_template(pool_type)
    try:
        existing = client.read_work_pool(name)
    except ObjectNotFound:
        template = with_variable_defaults(template, defaults or {})
        client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))
        return "created"
    # an update keeps the defaults an earlier bootstrap (or the UI) set, unless given anew
    ours = template["variables"]["properties"]
    kept = {k: v["default"] for k, v in (existing.base_job_template or {}).get("variables", {}).get(
        "properties", {}).items() if k in ours and "default" in v and v["default"] != ours[k].get("default")}
    template = with_variable_defaults(template, {**kept, **(defaults or {})})
    client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
    return "updated"


def ensure_concurrency_limit(client, limit: int) -> None:
    """Create or resize the global limit on paid workers."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(CONCURRENCY_LIMIT)
        client.update_global_concurrency_limit(CONCURRENCY_LIMIT, GlobalConcurrencyLimitUpdate(limit=limit))
    except ObjectNotFound:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=CONCURRENCY_LIMIT, limit=limit))


def register(block_type) -> None:
    """Register a block type; a concurrent bootstrap that registered it first is fine."""
    from prefect.exceptions import ObjectAlreadyExists, PrefectHTTPStatusError

    try:
        block_type.register_type_and_schema()
    except (ObjectAlreadyExists, PrefectHTTPStatusError) as exc:
        if "already exists" not in str(exc):
            raise
        block_type.register_type_and_schema()  # now an update of the existing type


def bootstrap(target: str, paid_worker_limit: int = PAID_WORKERS, image: str | None = None,
              env: dict[str, str] | None = None, command: str | None = None) -> dict:
    """Set up `target` on the current Prefect API (its pool's default image `image`,
    environment `env` and flow-run command `command` when given); return what was done."""
    from prefect.client.orchestration import get_client

    if target not in POOL_TYPES:
        raise ValueError(f"target: must be one of {', '.join(POOL_TYPES)}, got {target!r}")
    for block_type in (ZooidStore, ComputeTarget):
        register(block_type)
    ComputeTarget(**BUILTIN[target]).save(f"zooid-{target}", overwrite=True)
    with get_client(sync_client=True) as client:
        defaults = {"image": image, "env": env or None, "command": command}
        pool = ensure_pool(client, f"zooid-{target}", POOL_TYPES[target], {k: v for k, v in defaults.items() if v})
        ensure_concurrency_limit(client, paid_worker_limit)
    done = {"target": target, "work_pool": f"zooid-{target}", "pool": pool,
            "compute_target_block": f"zooid-{target}", "concurrency_limit": CONCURRENCY_LIMIT}
    if image:
        done["image"] = image
    return done


def block_reference(block_document_id) -> dict:
    """A job-template default that points at a saved block (how the UI stores one)."""
    return {"$ref": {"block_document_id": str(block_document_id)}}


def with_variable_defaults(base_job_template: dict, defaults: dict[str, Any]) -> dict:
    """A copy of a base job template with new defaults for some variables; unknown names are an error."""
    out = copy.deepcopy(base_job_template)
    props = out["variables"]["properties"]
    unknown = sorted(set(defaults) - set(props))
    if unknown:
        raise ValueError(f"defaults: not variables of this template: {', '.join(unknown)}")
    for name, value in defaults.items():
        if value is not None:
            props[name]["default"] = value
    return out


def bootstrap_cloud(target: str, *, cluster: str | None = None, resource_group: str | None = None,
                    subscription_id: str | None = None, namespace: str | None = None,
                    paid_worker_limit: int = PAID_WORKERS, image: str | None = None,
                    env: dict[str, str] | None = None) -> dict:
    """Bootstrap a cloud target (`ecs`, `aci`, `k8s`) idempotently; returns what was set, no secrets.

    The credentials block is created from AWS_* / AZURE_* variables when they are set (else the
    workers use their role or identity), and the pool's template defaults then reference it.
    Which options a target takes, which it needs, and its credentials block are its provider's
    (`clouds.registry.provider_of_builtin`: `account_options`, `account_required`,
    `credentials_block`, `credentials_variable`).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    if target not in CLOUD_ACCOUNT_TARGETS:
        raise ValueError(f"target: must be {', '.join(CLOUD_ACCOUNT_TARGETS[:-1])} or {CLOUD_ACCOUNT_TARGETS[-1]}, "
                         f"got {target!r}")
    provider = provider_of_builtin(target)
    account = {"cluster": cluster, "resource_group": resource_group, "subscription_id": subscription_id,
               "namespace": namespace}
    missing = [option for option in provider.account_required if not account[option]]
    if missing:
        raise ValueError(f"{missing[0]}: {provider.title} needs {' and '.join(provider.account_required)}")
    done = bootstrap(target, paid_worker_limit, image, env)
    for cls in store_block_types():
        register(cls)
    defaults: dict[str, Any] = {variable: account[option] for option, variable in provider.account_options.items()}
    creds = provider.credentials_block(os.environ)
    if creds is not None:
        name, block = creds
        block_id = block.save(name, overwrite=True)
        defaults[provider.credentials_variable] = block_reference(block_id)
        done["credentials_block"] = name
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(done["work_pool"])
        client.update_work_pool(done["work_pool"], WorkPoolUpdate(
            base_job_template=with_variable_defaults(pool.base_job_template, defaults)))
    done["defaults"] = sorted(k for k, v in defaults.items() if v is not None)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.bootstrap", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, choices=sorted(POOL_TYPES))
    parser.add_argument("--paid-worker-limit", type=int, default=PAID_WORKERS)
    parser.add_argument("--image", help="the pool's default worker image (e.g. what `make image` built)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="the pool's default environment for every worker (repeatable)")
    parser.add_argument("--command", help="the pool's command for a flow run (process pools; the local stack "
                                          "points it at its fork server, flows.flow_forks)")
    cloud = parser.add_argument_group(f"cloud targets ({', '.join(CLOUD_ACCOUNT_TARGETS)})",
                                      bootstrap_cloud.__doc__.splitlines()[0])
    cloud.add_argument("--cloud", action="store_true",
                       help="also point the pool at the cloud account (implied by any option below)")
    cloud.add_argument("--cluster", help="ECS cluster name or ARN")
    cloud.add_argument("--resource-group", help="Azure resource group (ACI)")
    cloud.add_argument("--subscription-id", help="Azure subscription id (ACI)")
    cloud.add_argument("--namespace", help="Kubernetes namespace")
    blob = parser.add_argument_group("the ACI target's Azure Blob store")
    blob.add_argument("--blob-container", help="create this container and the zooid-azure-blob-store/zooid-aci block")
    blob.add_argument("--blob-prefix", default="zooid", help="the key prefix in the container")
    blob.add_argument("--blob-credentials", help="a saved azure-blob-storage-credentials block "
                      "(default: AZURE_STORAGE_CONNECTION_STRING, else --blob-account-url)")
    blob.add_argument("--blob-account-url", help="https://<account>.blob.core.windows.net (a managed identity)")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    try:
        if args.blob_container and not provider_of_builtin(args.target).blob_store:
            raise ValueError(f"blob_container: only the aci target's store is an Azure Blob container, "
                             f"not the {args.target} target's")
        if not (args.cloud or args.cluster or args.resource_group or args.subscription_id or args.namespace):
            done = bootstrap(args.target, args.paid_worker_limit, args.image, env, args.command)
        else:
            done = bootstrap_cloud(args.target, cluster=args.cluster, resource_group=args.resource_group,
                                   subscription_id=args.subscription_id, namespace=args.namespace,
                                   paid_worker_limit=args.paid_worker_limit, image=args.image, env=env)
        if args.blob_container:
            done.update(bootstrap_blob_store(args.blob_container, prefix=args.blob_prefix,
                                             credentials_block=args.blob_credentials,
                                             account_url=args.blob_account_url))
    except (ValueError, StoreError) as exc:
        print(f"error: {exc}")
        return 2
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())

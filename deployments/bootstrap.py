"""Create or update what a target needs on the Prefect API, idempotently.

`python -m deployments.bootstrap --target local|ecs|aci|k8s`:
- the work pool (`zooid-<target>`), with the base job template from
  `deployments/templates/<type>.json` when there is one, else the worker type's default;
- the Zooid block types (Store, Compute Target) and a Compute Target block for the target;
- a global concurrency limit `zooid-paid-workers` that caps paid workers across runs.
Running it twice changes nothing the second time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from blocks.compute import BUILTIN, ComputeTarget
from blocks.store import ZooidStore

POOL_TYPES = {"local": "process", "ecs": "ecs", "aci": "azure-container-instance", "k8s": "kubernetes"}
TEMPLATES = Path(__file__).with_name("templates")
from tasks.launchers import PAID_WORKERS_LIMIT as CONCURRENCY_LIMIT


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


def ensure_pool(client, name: str, pool_type: str) -> str:
    """Create the work pool or update its template; return 'created' or 'updated'."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    template = base_job_template(pool_type)
    try:
        client.read_work_pool(name)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))
        return "created"
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


def bootstrap(target: str, paid_worker_limit: int = 16) -> dict:
    """Set up `target` on the current Prefect API; return what was done."""
    from prefect.client.orchestration import get_client

    if target not in POOL_TYPES:
        raise ValueError(f"target: must be one of {', '.join(POOL_TYPES)}, got {target!r}")
    for block_type in (ZooidStore, ComputeTarget):
        register(block_type)
    ComputeTarget(**BUILTIN[target]).save(f"zooid-{target}", overwrite=True)
    with get_client(sync_client=True) as client:
        pool = ensure_pool(client, f"zooid-{target}", POOL_TYPES[target])
        ensure_concurrency_limit(client, paid_worker_limit)
    return {"target": target, "work_pool": f"zooid-{target}", "pool": pool,
            "compute_target_block": f"zooid-{target}", "concurrency_limit": CONCURRENCY_LIMIT}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.bootstrap", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, choices=sorted(POOL_TYPES))
    parser.add_argument("--paid-worker-limit", type=int, default=16)
    args = parser.parse_args(argv)
    print(json.dumps(bootstrap(args.target, args.paid_worker_limit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

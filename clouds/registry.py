"""Which provider serves a compute target: `PROVIDERS`, the one table from a target's kind to its
provider (`clouds.provider.Provider`, one class per module: its job variables, SKU tables,
adapter and bootstrap data). Every kind with a work pool has one entry; no other module maps a
kind to a provider, and callers look up here instead of branching on the kind.

Inline targets (the coordinator's own processes) have no pool and no entry; the process pool
has no cloud clock, no cloud resources to stop and nothing to sweep there (no adapter): the
process sweep (`coordinator.workers.sweep`) covers both.
"""
from __future__ import annotations

from clouds.aci import Aci
from clouds.adapter import CloudAdapter
from clouds.docker import Docker
from clouds.ecs import Ecs
from clouds.kubernetes import Kubernetes
from clouds.process import ProcessPool
from clouds.provider import JobVariablesError, Provider, WorkerResources
from core.kinds import CLOUD_KINDS, TargetKind

PROVIDERS: dict[TargetKind, type[Provider]] = {p.kind: p for p in (ProcessPool, Ecs, Aci, Kubernetes, Docker)}
"""Target kind -> its provider: every kind with a work pool (`TargetKind.remote`), once."""


def provider_for(kind) -> type[Provider] | None:
    """The provider of target kind `kind` (a `TargetKind` or its string), None for an inline target."""
    return PROVIDERS.get(kind)


def provider_of_builtin(name: str) -> type[Provider] | None:
    """The provider of the built-in target `name` (`local` -> the process pool), None for `inline`."""
    return next((p for p in PROVIDERS.values() if p.kind.builtin == name), None)


def is_cloud(target) -> bool:
    """Whether `target` (a `ComputeTarget`) runs its workers in containers on a provider's (or
    a container engine's) clock."""
    return target.kind in CLOUD_KINDS


def adapter_for(target) -> CloudAdapter | None:
    """The provider adapter for `target`'s work pool, or None for a local target."""
    provider = PROVIDERS.get(target.kind)
    if provider is None or provider.adapter is None:
        return None
    return provider.adapter(target.work_pool, target.job_variables)


def job_variables(kind: str, res: WorkerResources, run_id: str, *, image: str | None = None,
                  env: dict[str, str] | None = None, extra: dict | None = None, capacity: str = "on_demand",
                  **options) -> dict:
    """The `job_variables` for one worker on a cloud target of `kind` on `capacity` (`on_demand`
    or `spot`: `Provider.job_variables`, the plan's size over `extra`, the target's own
    variables; `env` merged)."""
    if kind not in CLOUD_KINDS:
        raise JobVariablesError("kind", f"must be one of {', '.join(CLOUD_KINDS)}, got {kind!r}")
    return PROVIDERS[kind].job_variables(res, run_id, image=image, env=env, extra=extra, capacity=capacity,
                                         **options)

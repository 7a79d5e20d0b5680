"""Which cloud adapter serves a compute target: the one place that maps a target's kind to its
provider module. Local targets (inline processes, the process pool) have no cloud clock, no
cloud resources to stop and nothing to sweep there; the process sweep (`coordinator.sweep`) covers
them.
"""
from __future__ import annotations

from clouds.aci import AciAdapter
from clouds.adapter import CloudAdapter
from clouds.docker import DockerAdapter
from clouds.ecs import EcsAdapter
from clouds.kubernetes import KubernetesAdapter

CLOUD_KINDS = ("ecs", "aci", "k8s", "docker")
"""Target kinds whose workers run in containers that a provider (or a Docker-API engine)
starts and clocks; the rest run as this machine's processes."""


def is_cloud(target) -> bool:
    """Whether `target` (a `ComputeTarget`) runs its workers in containers on a provider's (or
    a container engine's) clock."""
    return target.kind in CLOUD_KINDS


def adapter_for(target) -> CloudAdapter | None:
    """The provider adapter for `target`'s work pool, or None for a local target."""
    if target.kind == "ecs":
        return EcsAdapter(target.work_pool, target.job_variables)
    if target.kind == "aci":
        return AciAdapter(target.work_pool, target.job_variables)
    if target.kind == "k8s":
        return KubernetesAdapter(target.work_pool, target.job_variables)
    if target.kind == "docker":
        return DockerAdapter(target.work_pool, target.job_variables)
    return None

"""Which cloud adapter serves a compute target: the one place that maps a target's kind to its
provider module. Local targets (inline processes, the process pool) have no cloud clock, no
cloud resources to stop and nothing to sweep there; the process sweep (`coordinator.workers.sweep`) covers
them.
"""
from __future__ import annotations

from clouds.aci import AciAdapter
from clouds.adapter import CloudAdapter
from clouds.docker import DockerAdapter
from clouds.ecs import EcsAdapter
from clouds.kubernetes import KubernetesAdapter
from core.kinds import CLOUD_KINDS, TargetKind


def is_cloud(target) -> bool:
    """Whether `target` (a `ComputeTarget`) runs its workers in containers on a provider's (or
    a container engine's) clock."""
    return target.kind in CLOUD_KINDS


def adapter_for(target) -> CloudAdapter | None:
    """The provider adapter for `target`'s work pool, or None for a local target."""
    if target.kind == TargetKind.ECS:
        return EcsAdapter(target.work_pool, target.job_variables)
    if target.kind == TargetKind.ACI:
        return AciAdapter(target.work_pool, target.job_variables)
    if target.kind == TargetKind.K8S:
        return KubernetesAdapter(target.work_pool, target.job_variables)
    if target.kind == TargetKind.DOCKER:
        return DockerAdapter(target.work_pool, target.job_variables)
    return None

"""Kubernetes workers: their cost on the cluster's clock, the sweep that removes stragglers, and
the job of a flow run.

Every worker's Job and pod carry the label `zooid-run=<run_id>` (the job template sets it
from `zooid_run_id` and the `labels` job variable), and the pod carries Prefect's
`prefect.io/flow-run-id` label. The flow run's `infrastructure_pid` is `<namespace>:<job>`.

A pod is billed from `status.startTime` (the kubelet accepted it, so the image pull counts,
as on Fargate and ACI) to its container's `finishedAt`. A pod the scheduler could not place
(`PodScheduled=False`, reason `Unschedulable`: no node with a free `nvidia.com/gpu`) or that
failed before its container ever ran is a failed placement: listed, not billed.

The functions are coroutines over a `kubernetes_asyncio` `ApiClient` (what the Kubernetes
worker uses); `run_sync` runs one from synchronous code and `k8s_session` opens a client
from the work pool's cluster config block.

The provider (`Kubernetes`): workers get requests = limits (a Guaranteed pod), an
`nvidia.com/gpu` limit for GPUs and a node selector for the GPU model (`K8S_GPU_PRODUCTS`). Its
cloud bootstrap points the pool at a namespace.
"""
from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import Iterable

from clouds.adapter import FLOW_RUN_ID_LABEL, RUN_LABEL, CloudAdapter, CloudInterval, read_pool_job_configuration
from clouds.provider import FLOW_RUN_COMMAND, Provider, WorkerResources, run_labels
from clouds.timestamps import epoch_seconds
from core.kinds import Capacity, TargetKind

# GPU type as the price catalog names it -> the Kubernetes node label value that selects it
# (NVIDIA GPU feature discovery's `nvidia.com/gpu.product`).
K8S_GPU_PRODUCTS = {"T4": "Tesla-T4", "V100": "Tesla-V100-SXM2-16GB", "A10G": "NVIDIA-A10G",
                    "K80": "Tesla-K80", "P100": "Tesla-P100-PCIE-16GB", "A100": "NVIDIA-A100-SXM4-40GB"}


K8S_SPOT_LABEL = ("kubernetes.azure.com/scalesetpriority", "spot")
"""The label and taint of a spot node pool's nodes, AKS's convention: AKS labels every node of a
`--priority Spot` pool `kubernetes.azure.com/scalesetpriority=spot` and taints it with the same
key and value (`NoSchedule`), so a spot worker selects those nodes and tolerates the taint. (EKS
managed node groups label `eks.amazonaws.com/capacityType=SPOT`, GKE `cloud.google.com/gke-spot=true`:
a cluster labelled so would change this pair.)"""


def _unschedulable(pod) -> bool:
    return any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
               for c in (pod.status.conditions or []))


def pod_interval(pod) -> CloudInterval:
    """One pod as a `CloudInterval`."""
    status = pod.status
    containers = status.container_statuses or []
    running = [c.state.running for c in containers if c.state and c.state.running]
    terminated = [c.state.terminated for c in containers if c.state and c.state.terminated]
    started_at = [epoch_seconds(s.started_at) for s in running + terminated if s.started_at]
    started = min(started_at) if started_at else None
    finished = max((epoch_seconds(t.finished_at) for t in terminated if t.finished_at), default=None)
    phase = status.phase
    if phase == "Succeeded":
        state = "completed"
    elif phase == "Failed":
        state = "failed" if started is not None else "failed_placement"
    elif phase == "Pending" and _unschedulable(pod):
        state = "failed_placement"
    else:
        state = "running"
    reason = next((c.message or c.reason or "" for c in (status.conditions or []) if c.status == "False"), "")
    return CloudInterval(resource=pod.metadata.name, flow_run_id=(pod.metadata.labels or {}).get(FLOW_RUN_ID_LABEL),
                         billed_from=epoch_seconds(status.start_time), stopped=finished if state != "running" else None,
                         status=state, created=epoch_seconds(pod.metadata.creation_timestamp), started=started,
                         reason=status.reason or reason)


async def list_run_pods(api_client, namespace: str, run_id: str) -> list:
    """The run's pods (label `zooid-run=<run_id>`)."""
    from kubernetes_asyncio.client import CoreV1Api

    pods = await CoreV1Api(api_client).list_namespaced_pod(namespace, label_selector=f"{RUN_LABEL}={run_id}")
    return list(pods.items)


async def run_intervals(api_client, namespace: str, run_id: str) -> list[CloudInterval]:
    """Every pod of the run the cluster still lists, on the cluster's clock."""
    return [pod_interval(p) for p in await list_run_pods(api_client, namespace, run_id)]


async def delete_jobs(api_client, namespace: str, names: Iterable[str]) -> list[str]:
    """Delete Jobs and, through background propagation, their pods; a Job already gone is skipped."""
    from kubernetes_asyncio.client import BatchV1Api
    from kubernetes_asyncio.client.exceptions import ApiException

    batch, deleted = BatchV1Api(api_client), []
    for name in names:
        try:
            await batch.delete_namespaced_job(name, namespace, propagation_policy="Background",
                                              grace_period_seconds=0)
        except ApiException as exc:
            if exc.status == 404:
                continue
            raise
        deleted.append(name)
    return deleted


async def sweep(api_client, namespace: str, run_id: str) -> dict[str, list[str]]:
    """Delete every Job of the run and any of its pods still alive (a pod whose Job is gone)."""
    from kubernetes_asyncio.client import BatchV1Api, CoreV1Api
    from kubernetes_asyncio.client.exceptions import ApiException

    jobs = await BatchV1Api(api_client).list_namespaced_job(namespace, label_selector=f"{RUN_LABEL}={run_id}")
    deleted_jobs = await delete_jobs(api_client, namespace, [j.metadata.name for j in jobs.items])
    core, deleted_pods = CoreV1Api(api_client), []
    for pod in await list_run_pods(api_client, namespace, run_id):
        if pod.status.phase in ("Succeeded", "Failed") or pod.metadata.deletion_timestamp is not None:
            continue
        try:
            await core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise
            continue
        deleted_pods.append(pod.metadata.name)
    return {"jobs": deleted_jobs, "pods": deleted_pods}


def job_of_flow_run(flow_run) -> tuple[str, str] | None:
    """(namespace, job name) of a worker flow run, from its `infrastructure_pid` `<namespace>:<job>`."""
    pid = getattr(flow_run, "infrastructure_pid", None) or ""
    namespace, sep, job = pid.partition(":")
    return (namespace, job) if sep and namespace and job and ":" not in job else None


async def delete_flow_run_jobs(api_client, flow_runs: Iterable) -> list[str]:
    """Delete the Job behind each flow run directly, without waiting for a worker to see the
    cancellation."""
    deleted = []
    for fr in flow_runs:
        found = job_of_flow_run(fr)
        if found is not None:
            deleted += await delete_jobs(api_client, found[0], [found[1]])
    return deleted


@asynccontextmanager
async def k8s_session(work_pool: str, job_variables: dict | None = None):
    """(ApiClient, namespace) as the pool's workers see them (its cluster config block, or the
    in-cluster / local kubeconfig when the pool names none)."""
    from kubernetes_asyncio import config
    from kubernetes_asyncio.client import ApiClient
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    cfg = await read_pool_job_configuration(KubernetesWorkerJobConfiguration, work_pool, job_variables)
    if cfg.cluster_config:
        client = await config.new_client_from_config_dict(config_dict=cfg.cluster_config.config,
                                                          context=cfg.cluster_config.context_name)
    else:
        try:
            config.load_incluster_config()
            client = ApiClient()
        except config.ConfigException:
            client = await config.new_client_from_config()
    try:
        yield client, cfg.namespace
    finally:
        await client.close()


def run_sync(coro):
    """Run one of these coroutines from synchronous code (a Prefect task, a hook)."""
    from prefect.utilities.asyncutils import run_coro_as_sync

    return run_coro_as_sync(coro)


class KubernetesAdapter(CloudAdapter):
    """Kubernetes behind the adapter interface (the coroutines run to completion here)."""

    def intervals(self, run_id: str) -> list[CloudInterval]:
        async def _read():
            async with k8s_session(self.work_pool, self.job_variables) as (client, namespace):
                return await run_intervals(client, namespace, run_id)

        return run_sync(_read())

    def stop(self, flow_runs: Iterable) -> list[str]:
        async def _stop():
            async with k8s_session(self.work_pool, self.job_variables) as (client, _):
                return await delete_flow_run_jobs(client, flow_runs)

        return run_sync(_stop())

    def sweep(self, run_id: str) -> list[str]:
        async def _sweep():
            async with k8s_session(self.work_pool, self.job_variables) as (client, namespace):
                done = await sweep(client, namespace, run_id)
                return done["jobs"] + done["pods"]

        return run_sync(_sweep())


def k8s_job_variables(res: WorkerResources, run_id: str) -> dict:
    """Kubernetes: requests equal limits (a Guaranteed pod), an `nvidia.com/gpu` limit for GPUs; the
    flow run's engine as the container's args (`FLOW_RUN_COMMAND`)."""
    cpu = f"{math.ceil(res.vcpu * 1000 - 1e-9)}m"
    memory = f"{math.ceil(res.requested_memory_gb * 1024 - 1e-9)}Mi"
    out = {"cpu_request": cpu, "cpu_limit": cpu, "memory_request": memory, "memory_limit": memory,
           "zooid_run_id": run_id, "labels": run_labels(run_id), "command": FLOW_RUN_COMMAND}
    if res.gpu:
        out["gpu_limit"] = res.gpu
        out["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        product = K8S_GPU_PRODUCTS.get(res.gpu_type or "")
        if product:
            out["node_selector"] = {"nvidia.com/gpu.product": product}
    return out


class Kubernetes(Provider):
    """The `k8s` target: Jobs started by prefect-kubernetes's worker."""

    kind = TargetKind.K8S
    title = "Kubernetes"
    adapter = KubernetesAdapter
    account_options = {"namespace": "namespace"}

    @classmethod
    def size(cls, res: WorkerResources, run_id: str) -> dict:
        return k8s_job_variables(res, run_id)

    @classmethod
    def on_capacity(cls, sized: dict, capacity: str) -> dict:
        """Spot: a node selector and a toleration for the spot node pool (`K8S_SPOT_LABEL`, laid
        beside a GPU worker's own); on-demand: as sized."""
        if capacity != Capacity.SPOT:
            return super().on_capacity(sized, capacity)
        key, value = K8S_SPOT_LABEL
        return {**sized, "node_selector": {**sized.get("node_selector", {}), key: value},
                "tolerations": [*sized.get("tolerations", []),
                                {"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}]}

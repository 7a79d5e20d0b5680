"""From a plan's per-worker resources to the `job_variables` of one worker's `run_deployment`.

Pure: no Prefect, no cloud SDK. Each target's work pool template (`deployments/templates/`)
declares the variables filled here, so a worker gets exactly what the plan sized (Hydrozoa's
right-sized containers) instead of the pool's default:

- memory is the profiled peak plus headroom (a fraction of the peak plus a fixed allowance
  for the interpreter, torch and the store client), rounded up to what the cloud accepts;
- ECS CPU workers run on Fargate, rounded up to the smallest valid Fargate size; ECS GPU
  workers run on an EC2 capacity provider with a `resourceRequirements` GPU reservation;
- ACI workers carry cpu, memory and, for GPUs, `{"count", "sku"}` in the ARM template, and
  keep their container group after exit so its events can be billed (the sweep deletes it);
- Kubernetes workers get requests = limits and an `nvidia.com/gpu` limit;
- Docker-API containers (the `docker` target) get a memory limit without extra swap and a
  CPU quota (`nano_cpus`), and, for GPUs, a device request;
- every worker carries the run id (`zooid_run_id`, and the `zooid-run` label/tag).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import ZooidValueError
from core.kinds import CLOUD_KINDS, TargetKind

RUN_LABEL = "zooid-run"

# Fargate's valid (CPU units, allowed memory MiB) pairs, smallest first.
FARGATE_SIZES: tuple[tuple[int, tuple[int, ...]], ...] = (
    (256, (512, 1024, 2048)),
    (512, tuple(range(1024, 4096 + 1, 1024))),
    (1024, tuple(range(2048, 8192 + 1, 1024))),
    (2048, tuple(range(4096, 16384 + 1, 1024))),
    (4096, tuple(range(8192, 30720 + 1, 1024))),
    (8192, tuple(range(16384, 61440 + 1, 4096))),
    (16384, tuple(range(32768, 122880 + 1, 8192))),
)
ACI_GPU_SKUS = ("K80", "P100", "V100")
# GPU type as the price catalog names it -> the Kubernetes node label value that selects it
# (NVIDIA GPU feature discovery's `nvidia.com/gpu.product`).
K8S_GPU_PRODUCTS = {"T4": "Tesla-T4", "V100": "Tesla-V100-SXM2-16GB", "A10G": "NVIDIA-A10G",
                    "K80": "Tesla-K80", "P100": "Tesla-P100-PCIE-16GB", "A100": "NVIDIA-A100-SXM4-40GB"}


class JobVariablesError(ZooidValueError):
    """A worker size or target kind that no job template can express (names the field)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerResources:
    """What one worker needs, as the plan and the profiler measured it."""

    vcpu: float
    """vCPUs per worker (the plan's `worker_vcpu`)."""
    memory_gb: float
    """Profiled peak memory of the worker in GB (before headroom)."""
    gpu: int = 0
    """GPUs per worker."""
    gpu_type: str | None = None
    """GPU model as the price catalog names it (`K80`, `T4`, `V100`, ...); required when gpu > 0."""
    headroom: float = 0.25
    """Extra memory as a fraction of the profiled peak (allocator slack, batch variation)."""
    base_memory_gb: float = 1.0
    """Fixed extra memory for what every worker holds besides its model's training: measured in
    the worker image, 0.31 GB resident once Python, torch, Prefect and the store client are
    imported, plus Prefect's flow-run executor (the container's first process) beside it; with
    0.5 GB a warm worker on the docker target was killed for memory after its first epoch."""

    def __post_init__(self) -> None:
        for name in ("vcpu", "memory_gb"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise JobVariablesError(name, f"must be a finite number > 0, got {value!r}")
        if not isinstance(self.gpu, int) or self.gpu < 0:
            raise JobVariablesError("gpu", f"must be an integer >= 0, got {self.gpu!r}")
        if self.gpu and not self.gpu_type:
            raise JobVariablesError("gpu_type", "required when gpu > 0 (e.g. K80, T4, V100)")
        if not (math.isfinite(self.headroom) and self.headroom >= 0):
            raise JobVariablesError("headroom", f"must be >= 0, got {self.headroom!r}")
        if not (math.isfinite(self.base_memory_gb) and self.base_memory_gb >= 0):
            raise JobVariablesError("base_memory_gb", f"must be >= 0, got {self.base_memory_gb!r}")

    @property
    def requested_memory_gb(self) -> float:
        """Memory to ask for: the profiled peak plus headroom."""
        return self.memory_gb * (1.0 + self.headroom) + self.base_memory_gb


def resources_from_plan(plan, profiled_memory_gb: float | None = None, gpu_type: str | None = None,
                        headroom: float = 0.25, base_memory_gb: float = 1.0) -> WorkerResources:
    """`WorkerResources` of a `core.plan.Plan`; the plan's memory is used when nothing was profiled."""
    return WorkerResources(vcpu=plan.worker_vcpu, memory_gb=profiled_memory_gb or plan.worker_memory_gb,
                           gpu=plan.worker_gpu, gpu_type=gpu_type, headroom=headroom, base_memory_gb=base_memory_gb)


def fargate_size(vcpu: float, memory_gb: float) -> tuple[int, int]:
    """The smallest valid Fargate (CPU units, memory MiB) with at least `vcpu` and `memory_gb`."""
    units = math.ceil(vcpu * 1024 - 1e-9)
    mib = math.ceil(memory_gb * 1024 - 1e-9)
    for cpu, memories in FARGATE_SIZES:
        if cpu < units:
            continue
        fits = [m for m in memories if m >= mib]
        if fits:
            return cpu, fits[0]
    raise JobVariablesError("memory_gb", f"{memory_gb:g} GB with {vcpu:g} vCPU exceeds the largest Fargate "
                            "task (16 vCPU, 120 GB); use an EC2 capacity provider")


def _labels(run_id: str) -> dict[str, str]:
    return {RUN_LABEL: run_id}


def ecs_job_variables(res: WorkerResources, run_id: str, gpu_capacity_provider: str = "zooid-gpu") -> dict:
    """ECS: Fargate for CPU workers, an EC2 capacity provider plus a GPU reservation otherwise."""
    if res.gpu == 0:
        cpu, memory = fargate_size(res.vcpu, res.requested_memory_gb)
        return {"launch_type": "FARGATE", "cpu": cpu, "memory": memory,
                "zooid_run_id": run_id, "labels": _labels(run_id)}
    # On EC2 the container reserves CPU units and MiB on an instance: no Fargate grid to round to.
    return {"launch_type": "EC2",
            "capacity_provider_strategy": [{"capacityProvider": gpu_capacity_provider, "weight": 1, "base": 0}],
            "cpu": math.ceil(res.vcpu * 1024 - 1e-9), "memory": math.ceil(res.requested_memory_gb * 1024 - 1e-9),
            "resource_requirements": [{"type": "GPU", "value": str(res.gpu)}],
            "zooid_run_id": run_id, "labels": _labels(run_id)}


def aci_job_variables(res: WorkerResources, run_id: str) -> dict:
    """ACI: cpu and memory (0.1 GB steps) and, for GPU workers, `{"count", "sku"}`."""
    # Keep the group after the container exits: its events are the bill (the sweep deletes it).
    out = {"cpu": math.ceil(res.vcpu * 10 - 1e-9) / 10, "memory": math.ceil(res.requested_memory_gb * 10 - 1e-9) / 10,
           "keep_container_group": True, "zooid_run_id": run_id, "labels": _labels(run_id)}
    if res.gpu:
        sku = (res.gpu_type or "").upper()
        if sku not in ACI_GPU_SKUS:
            raise JobVariablesError("gpu_type", f"ACI offers {', '.join(ACI_GPU_SKUS)}, got {res.gpu_type!r}")
        out["gpu"] = {"count": res.gpu, "sku": sku}
    return out


def k8s_job_variables(res: WorkerResources, run_id: str) -> dict:
    """Kubernetes: requests equal limits (a Guaranteed pod), an `nvidia.com/gpu` limit for GPUs."""
    cpu = f"{math.ceil(res.vcpu * 1000 - 1e-9)}m"
    memory = f"{math.ceil(res.requested_memory_gb * 1024 - 1e-9)}Mi"
    out = {"cpu_request": cpu, "cpu_limit": cpu, "memory_request": memory, "memory_limit": memory,
           "zooid_run_id": run_id, "labels": _labels(run_id)}
    if res.gpu:
        out["gpu_limit"] = res.gpu
        out["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        product = K8S_GPU_PRODUCTS.get(res.gpu_type or "")
        if product:
            out["node_selector"] = {"nvidia.com/gpu.product": product}
    return out


def docker_job_variables(res: WorkerResources, run_id: str) -> dict:
    """A Docker-API container: `mem_limit` (MiB, no swap beyond it) and a CPU quota in
    `nano_cpus`; GPUs through a device request (Docker's `--gpus`)."""
    memory = f"{math.ceil(res.requested_memory_gb * 1024 - 1e-9)}m"
    create = {"nano_cpus": math.ceil(res.vcpu * 1e9 - 1e-9)}
    if res.gpu:
        create["device_requests"] = [{"driver": "nvidia", "count": res.gpu, "capabilities": [["gpu"]]}]
    return {"mem_limit": memory, "memswap_limit": memory, "container_create_kwargs": create,
            "zooid_run_id": run_id, "labels": _labels(run_id)}


def job_variables(kind: str, res: WorkerResources, run_id: str, *, image: str | None = None,
                  env: dict[str, str] | None = None, extra: dict | None = None, **options) -> dict:
    """The `job_variables` for one worker on target `kind` (`ecs`, `aci`, `k8s` or `docker`).

    `extra` (e.g. the ComputeTarget block's own job variables: cluster, subnets, resource group)
    is laid under the sized values, so the plan's size always wins; `env` is merged.
    """
    builders = {TargetKind.ECS: ecs_job_variables, TargetKind.ACI: aci_job_variables,
                TargetKind.K8S: k8s_job_variables, TargetKind.DOCKER: docker_job_variables}
    if kind not in builders:
        raise JobVariablesError("kind", f"must be one of {', '.join(CLOUD_KINDS)}, got {kind!r}")
    if not run_id:
        raise JobVariablesError("run_id", "must not be empty")
    sized = builders[kind](res, run_id, **options)
    out = {**(extra or {}), **sized}
    out["labels"] = {**(extra or {}).get("labels", {}), **sized["labels"]}
    if "container_create_kwargs" in sized:  # the target's own create options stay beside the size
        out["container_create_kwargs"] = {**(extra or {}).get("container_create_kwargs", {}),
                                          **sized["container_create_kwargs"]}
    merged_env = {**(extra or {}).get("env", {}), **(env or {})}
    if merged_env:
        out["env"] = merged_env
    if image:
        out["image"] = image
    return out

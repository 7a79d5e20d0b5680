"""What every provider module (`clouds.ecs`, `clouds.aci`, `clouds.kubernetes`, `clouds.docker`,
`clouds.process`) tells the rest of Zooid, and what their job variables share.

A provider is one class per module, a subclass of `Provider`, named once in
`clouds.registry.PROVIDERS` (the one table from a target kind to its provider). Its class holds,
for its kind:

- `size(res, run_id)`: the job variables that size one worker (the provider's own SKU tables
  beside it), which `job_variables` lays over the target's own and the environment;
- `adapter`: its `clouds.adapter.CloudAdapter` (the cloud's clock, stop, sweep, preflight), None
  for a pool with nothing to read on a cloud;
- its bootstrap data: the options that point its pool at a cloud account and the pool
  variables they fill (`account_options`), the ones it cannot do without (`account_required`),
  the credentials block made from the standard environment (`credentials_block`) and the pool
  variable that references it (`credentials_variable`), whether its store is an Azure Blob
  container (`blob_store`); `deployments.bootstrap` makes the Prefect calls, one loop for all;
- what validation tells a user of it: the store its workers should use (`store_suggestion`)
  and the command that sets it up (`setup_command`).

Pure here: no Prefect, no cloud SDK (a provider imports its SDK inside the function that uses it).
Memory is the profiled peak plus headroom (a fraction of the peak plus a fixed allowance for the
interpreter, torch and the store client), rounded up to what the provider accepts; every worker
carries the run id (`zooid_run_id`, and the `zooid-run` label or tag).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from clouds.adapter import RUN_LABEL, CloudAdapter
from core.errors import ZooidValueError
from core.kinds import Capacity, TargetKind


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


FLOW_RUN_COMMAND = "python3 -m prefect.engine"
"""A worker container's command on every container target (docker, ECS, ACI, Kubernetes): the
flow run's engine itself, as the container's main process with the flow in its main thread (it
reads `PREFECT__FLOW_RUN_ID`), so that the provider's stop (a spot notice: `stop -t GRACE`, Fargate
Spot's SIGTERM, ACI's eviction, a pod's termination) reaches the worker's own SIGTERM handler
(`engine.preemption`). Prefect's default, `prefect flow-run execute`, is a supervisor that runs
the engine in a child process of its own: the provider's SIGTERM would reach the supervisor, not
the flow, and the worker would be killed at the end of the grace with nothing handed over."""


def run_labels(run_id: str) -> dict[str, str]:
    """The label (tag) every worker of the run carries: the sweep and the bill find it by it."""
    return {RUN_LABEL: run_id}


class Provider:
    """One target kind's provider: its job variables, its adapter and its bootstrap data, read
    from the class (never instantiated). Subclasses set `kind` and what differs from here."""

    kind: ClassVar[TargetKind]
    """The target kind it serves (`core.kinds.TargetKind`, which holds the pool type)."""
    title: ClassVar[str]
    """How messages name it (`ECS`, `ACI`, ...)."""
    adapter: ClassVar[type[CloudAdapter] | None] = None
    """The cloud's view of its pool (`clouds.adapter.CloudAdapter`); None: nothing on a cloud to read."""
    account_options: ClassVar[Mapping[str, str]] = {}
    """`deployments.bootstrap_cloud`'s options that point its pool at a cloud account -> the
    pool template's variable each fills (`resource_group` -> `resource_group_name`)."""
    account_required: ClassVar[tuple[str, ...]] = ()
    """Of `account_options`, those a cloud bootstrap cannot do without."""
    credentials_variable: ClassVar[str | None] = None
    """The pool variable that references the credentials block (`credentials_block`)."""
    blob_store: ClassVar[bool] = False
    """Its workers' store is an Azure Blob container, which its bootstrap may create."""
    store_suggestion: ClassVar[str] = "an S3 or Redis store (a URL or a Zooid Store block)"
    """The store its workers in containers should use (said when a directory store is refused)."""

    @classmethod
    def pool_type(cls) -> str | None:
        """The Prefect work-pool type its workers are launched through (the kind's)."""
        return cls.kind.pool_type

    @classmethod
    def setup_command(cls) -> str:
        """What sets its pool and worker deployment up (said when they are missing)."""
        return f"`python -m deployments.bootstrap --target {cls.kind.builtin}` and `prefect deploy`"

    @classmethod
    def size(cls, res: WorkerResources, run_id: str) -> dict:
        """The job variables that size one worker of `res` and carry `run_id` (its `labels` among them)."""
        raise JobVariablesError("kind", f"the {cls.kind} target's pool takes no worker size")

    @classmethod
    def on_capacity(cls, sized: dict, capacity: str) -> dict:
        """`sized` (the job variables of `size`) asking for `capacity` (`core.kinds.Capacity`:
        `on_demand` or `spot`). Here: on-demand only; a provider with a spot offer overrides it."""
        if capacity != Capacity.ON_DEMAND:
            raise JobVariablesError("capacity", f"the {cls.kind} target's pool takes no {capacity} capacity")
        return sized

    @classmethod
    def job_variables(cls, res: WorkerResources, run_id: str, *, image: str | None = None,
                      env: dict[str, str] | None = None, extra: dict | None = None,
                      capacity: str = Capacity.ON_DEMAND, **options) -> dict:
        """The `job_variables` for one worker of `res` on `capacity` (`on_capacity`).

        `extra` (e.g. the ComputeTarget block's own job variables: cluster, subnets, resource group)
        is laid under the sized values, so the plan's size always wins; `env` is merged.
        """
        if not run_id:
            raise JobVariablesError("run_id", "must not be empty")
        sized = cls.on_capacity(cls.size(res, run_id, **options), str(capacity))
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

    @classmethod
    def credentials_block(cls, environ: Mapping[str, str]) -> tuple[str, Any] | None:
        """(block name, unsaved credentials block) from the standard environment variables, or
        None when they are unset (the workers then use their role or identity)."""
        return None

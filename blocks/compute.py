"""The `Zooid Compute Target` block: where workers run and what they cost.

Built-in names (`inline`, `local`, `docker`, `ecs`, `aci`, `k8s`) resolve to defaults without a saved
block; any other name loads a saved block of this type.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from prefect.blocks.core import Block
from pydantic import Field, field_validator

from core.kinds import TargetKind, choices

Kind = choices(*TargetKind)


class ComputeTarget(Block):
    """A work pool (or the coordinator's own processes), worker size, image and billing offer."""

    _block_type_name = "Zooid Compute Target"
    _block_type_slug = "zooid-compute-target"
    _description = "Where Zooid's workers run, how big each is, and the offer they are billed as."

    kind: Kind = Field("process", title="Kind", description="inline, process, ecs, aci, k8s or docker.")
    work_pool: Optional[str] = Field(None, title="Work pool", description="Pool the worker deployment runs on.")
    worker_deployment: Optional[str] = Field(None, title="Worker deployment", description="e.g. worker/local.")
    offer: str = Field("aci-cpu", title="Billing offer", description="Price-catalog offer each worker is billed as.")
    worker_vcpu: float = Field(1.0, gt=0, title="vCPU per worker")
    worker_memory_gb: float = Field(2.0, gt=0, title="Memory per worker (GB)")
    worker_gpu: int = Field(0, ge=0, title="GPUs per worker")
    coordinator_vcpu: float = Field(
        0.5, gt=0, title="vCPU of the coordinator",
        description="The size the train flow's own container runs at (set the train deployment's job "
                    "variables to match): the coordinator is billed at it, on-demand.")
    coordinator_memory_gb: Optional[float] = Field(
        None, gt=0, title="Memory of the coordinator (GB)",
        description="It holds the model a few times over (`core.coordinator_size`, checked before anything is "
                    "rented); empty: the whole GB that holds it, at least 1.")
    coordinator_offer: Optional[str] = Field(
        None, title="Coordinator's billing offer",
        description="Price-catalog offer the coordinator is billed as; empty: the workers' offer "
                    "(set a CPU offer where the workers' is a GPU machine).")
    worker_memory_options_gb: list[float] = Field(
        default_factory=list, title="Memory sizes a worker may take (GB)",
        description="Memory tiers of the offer (e.g. [1, 2, 4, 8]); with two or more the plan chooses one "
                    "per pipeline stage with the co-optimiser. Empty: every worker is `worker_memory_gb`.")
    image: Optional[str] = Field(None, title="Worker image")
    region: Optional[str] = Field(None, title="Region")
    max_paid_workers: int = Field(16, gt=0, title="Global cap on paid workers")
    job_variables: dict[str, Any] = Field(default_factory=dict, title="Extra job variables")
    startup_s: float = Field(0.0, ge=0, title="Expected worker start-up (s)")

    @field_validator("worker_memory_options_gb")
    @classmethod
    def _memory_options(cls, values: list[float]) -> list[float]:
        problem = memory_options_problem(values)
        if problem:
            raise ValueError(problem)
        return values

    def memory_options(self) -> tuple[float, ...]:
        """The worker sizes (GB) the plan may choose among, ascending, without repeats:
        `worker_memory_options_gb`, or `worker_memory_gb` alone when it is empty."""
        return tuple(sorted(set(self.worker_memory_options_gb))) or (self.worker_memory_gb,)

    @property
    def remote(self) -> bool:
        """Whether workers run outside the coordinator's process tree (through a work pool)."""
        return TargetKind(self.kind).remote


def memory_options_problem(values) -> str:
    """What is wrong with a `worker_memory_options_gb` value, in one line ("" when nothing)."""
    if not isinstance(values, (list, tuple)):
        return f"worker_memory_options_gb: must be a list of sizes in GB, got {values!r}"
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))
           or not math.isfinite(v) or v <= 0]
    if bad:
        return f"worker_memory_options_gb: every size must be a finite number of GB > 0, got {list(values)}"
    return ""


def _builtin(kind: TargetKind) -> dict[str, Any]:
    """The built-in target of `kind` (`core.kinds.TargetKind`): its pool `zooid-<name>` and worker
    deployment `worker/<name>` where it has a pool, its offer, one vCPU and 2 GB per worker."""
    pool = dict(work_pool=f"zooid-{kind.builtin}", worker_deployment=f"worker/{kind.builtin}") if kind.remote else {}
    return dict(kind=kind.value, **pool, offer=kind.offer, worker_vcpu=1.0, worker_memory_gb=2.0)


BUILTIN = {kind.builtin: _builtin(kind) for kind in TargetKind}
"""Built-in target name -> the `ComputeTarget` fields it resolves to without a saved block."""


def resolve_target(name: str) -> ComputeTarget:
    """The built-in target `name` or the saved block of that name; ValueError naming `target`."""
    if name in BUILTIN:
        return ComputeTarget(**BUILTIN[name])
    try:
        return ComputeTarget.load(name)
    except (ValueError, Exception) as exc:  # Prefect raises ValueError or ObjectNotFound
        raise ValueError(f"target: unknown compute target {name!r}; valid: "
                         f"{', '.join(BUILTIN)} or a saved Zooid Compute Target block ({type(exc).__name__})") from None

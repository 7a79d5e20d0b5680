"""The names a job chooses among, each defined once: strategies, pipeline schedules and
compute-target kinds.

Each is a `StrEnum`, so a member *is* its string: `Strategy.PIPELINE == "pipeline"`, it hashes
like `"pipeline"`, `json.dumps` and f-strings write `pipeline`, and a plain string from a user
(`--param strategy=pipeline`, a plan read back from JSON) compares equal to the member. Code
elsewhere compares with the members and the sets below, never with string literals, and
lists none of these names again (`tests/test_one_of_each.py` reads the source to check).

- `Strategy`: how the job is split (`auto` lets the planner choose among the others);
- `PipelineSchedule`: the compute schedules `core.schedules.build_schedule` builds (the job's
  `pipeline_schedule` may also be `auto`: the planner picks among them);
- `Capacity`: on-demand or spot workers (`auto`: the planner picks);
- `TargetKind`: where workers run, one row per kind with its facts (the built-in target of
  that kind, its Prefect work-pool type, whether its workers share this machine's cores, run
  in containers on a provider's or engine's clock, or need a cloud account at bootstrap, and
  the offer the built-in target is billed as). Adding a kind is one row here; its provider
  module in `clouds/` (job variables, adapter, bootstrap data), named once in
  `clouds.registry.PROVIDERS`, and its pool template follow.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Literal

AUTO = "auto"
"""The job's "let the planner choose", for its strategy and its pipeline schedule."""


class Strategy(StrEnum):
    """How a job is split across workers."""

    AUTO = AUTO
    """The planner compares the others and picks one."""
    LOCAL_SGD = "local_sgd"
    """D data-parallel replicas that average every k steps."""
    PIPELINE = "pipeline"
    """One replica of an M-stage pipeline."""
    HYBRID = "hybrid"
    """D replicas of an M-stage pipeline, each stage synced across its replicas every step."""


PLAN_STRATEGIES = tuple(s for s in Strategy if s is not Strategy.AUTO)
"""What a plan runs (never `auto`)."""
PIPELINED_STRATEGIES = frozenset({Strategy.PIPELINE, Strategy.HYBRID})
"""Strategies that cut the model into stages and send activations between them."""
DATA_PARALLEL_STRATEGIES = frozenset({Strategy.LOCAL_SGD, Strategy.HYBRID})
"""Strategies whose plans run `workers` replicas that sync (a pipeline runs one replica)."""


class PipelineSchedule(StrEnum):
    """A pipeline's compute schedule (`core.schedules`)."""

    GPIPE = "gpipe"
    """Every forward, then every backward (FuncPipe, GPipe)."""
    ONE_F_ONE_B = "1f1b"
    """One forward, one backward (PipeDream-Flush, Megatron 1F1B)."""
    INTERLEAVED = "interleaved"
    """Megatron-LM's interleaved 1F1B: v >= 2 model chunks per worker."""


SINGLE_CHUNK_SCHEDULES = frozenset(s for s in PipelineSchedule if s is not PipelineSchedule.INTERLEAVED)
"""Schedules that run one model stage per worker (chunks = 1)."""


class Capacity(StrEnum):
    """What kind of capacity a job's workers rent (job field `capacity`)."""

    ON_DEMAND = "on_demand"
    """Capacity that runs until it is stopped, at the list price."""
    SPOT = "spot"
    """Spare capacity at a discount that the provider may take back after a notice."""
    AUTO = AUTO
    """The planner prices the expected re-done work against the discount and picks one."""


class TargetKind(StrEnum):
    """Where a compute target's workers run (`blocks.compute.ComputeTarget.kind`), with its facts.

    Each member's value is the kind; its attributes:

    - `builtin`: the name of the built-in target of this kind (`blocks.compute.BUILTIN`,
      `TrainJob.target`, `deployments.bootstrap --target`);
    - `pool_type`: the Prefect work-pool type its workers are launched through; None: no pool,
      the coordinator starts them as its own processes;
    - `shared_host`: its workers run on the coordinator's machine and share its cores;
    - `cloud`: its workers run in containers that a provider (or a Docker-API engine) starts and
      clocks, through a `clouds` adapter and job variables sized by the plan;
    - `cloud_account`: bootstrapping it points the pool at a cloud account (credentials block,
      cluster, resource group or namespace);
    - `offer`: the price-catalog offer its built-in target is billed as.
    """

    builtin: str
    pool_type: str | None
    shared_host: bool
    cloud: bool
    cloud_account: bool
    offer: str

    def __new__(cls, value: str, builtin: str, pool_type: str | None, shared_host: bool, cloud: bool,
                cloud_account: bool, offer: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.builtin, member.pool_type, member.offer = builtin, pool_type, offer
        member.shared_host, member.cloud, member.cloud_account = shared_host, cloud, cloud_account
        return member

    #         kind       built-in  pool type                   shared cloud  account offer
    INLINE = ("inline", "inline", None,                       True,  False, False,  "aci-cpu")
    PROCESS = ("process", "local", "process",                 True,  False, False,  "aci-cpu")
    ECS = ("ecs", "ecs", "ecs",                               False, True,  True,   "fargate-cpu")
    ACI = ("aci", "aci", "azure-container-instance",          False, True,  True,   "aci-cpu")
    K8S = ("k8s", "k8s", "kubernetes",                        False, True,  True,   "aci-cpu")
    # containers on a Docker-API engine (podman here) on this machine, billed as the Fargate task they stand in for
    DOCKER = ("docker", "docker", "docker",                   True,  True,  False,  "fargate-cpu")

    @property
    def remote(self) -> bool:
        """Whether its workers run outside the coordinator's process tree (through a work pool)."""
        return self.pool_type is not None


SHARED_HOST_KINDS = frozenset(k for k in TargetKind if k.shared_host)
"""Kinds whose workers run on the coordinator's machine and share its cores (docker's
containers too, each under a CPU quota of its vCPU)."""
CLOUD_KINDS = tuple(k for k in TargetKind if k.cloud)
"""Kinds whose workers run in containers that a provider (or a Docker-API engine) starts and
clocks; the rest run as this machine's processes."""
BUILTIN_TARGETS = tuple(k.builtin for k in TargetKind)
"""The built-in target names, each resolving to its kind's defaults without a saved block."""
CLOUD_ACCOUNT_TARGETS = tuple(k.builtin for k in TargetKind if k.cloud_account)
"""The built-in targets whose bootstrap can point the pool at a cloud account."""


def builtin_kind(name: str) -> TargetKind | None:
    """The kind of the built-in target `name` (`local` -> `process`), None for any other name."""
    return next((k for k in TargetKind if k.builtin == name), None)


def choices(*names: str) -> type:
    """A `typing.Literal` of `names` (e.g. `choices(*Strategy)`), for a pydantic field that
    takes one of them as a plain string and shows them as a choice list in its JSON schema."""
    return Literal[tuple(str(n) for n in names)]

"""The one interface every cloud provider sits behind (`CloudAdapter`), and what they share: a
worker's life on the cloud's clock (`CloudInterval`), Prefect's flow-run label, and the work
pool's job configuration.

A worker is launched and polled through the target's Prefect work pool: the pool's own
Prefect worker (prefect-aws, prefect-azure, prefect-kubernetes) starts the container and
`coordinator.workers.launchers.PoolLauncher` watches the flow run, the same for every provider. What
differs per provider is what the cloud itself says and does, and that is an adapter:

- `intervals(run_id)`: every worker of the run on the cloud's billing clock;
- `stop(flow_runs)`: stop the infrastructure behind worker flow runs at once;
- `sweep(run_id)`: stop everything the run still has running;
- `settle(run_id)`: before the last bill, wait for workers told to stop to have stopped;
- `ended(infrastructure_pid)`: whether a worker's infrastructure died under a running flow run;
- `preflight(image)`: refuse, before anything is paid, a target that cannot start a worker.

One module per provider (`clouds.ecs`, `clouds.aci`, `clouds.kubernetes`, `clouds.docker`)
implements it, and names it as its `clouds.provider.Provider`'s `adapter`;
`clouds.registry.adapter_for(target)` picks one for a `ComputeTarget`, so `tasks/` never
names a provider.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable

FLOW_RUN_ID_LABEL = "prefect.io/flow-run-id"
RUN_LABEL = "zooid-run"
"""The label (ECS and ACI: the tag) that carries the run id on every worker's infrastructure."""


@dataclass(frozen=True, kw_only=True)
class CloudInterval:
    """One worker's infrastructure as its cloud reported it (epoch seconds, UTC)."""

    resource: str
    """Task ARN, container group name or pod name."""
    flow_run_id: str | None
    """The worker flow run it carried (from the `prefect.io/flow-run-id` tag, label or name)."""
    billed_from: float | None
    """When billing began: image pull start on Fargate and ACI, container start on Kubernetes."""
    stopped: float | None
    """When it stopped (None: still running)."""
    status: str
    """`completed`, `failed`, `running` or `failed_placement` (never started)."""
    created: float | None = None
    started: float | None = None
    """When the worker's container started running (after the pull)."""
    reason: str = ""

    @property
    def startup_s(self) -> float | None:
        """Seconds from creation to a running container (the pre-start planner's input)."""
        if self.created is None or self.started is None:
            return None
        return max(0.0, self.started - self.created)


async def read_pool_job_configuration(config_cls, work_pool: str, job_variables: dict | None = None):
    """The job configuration a worker of `work_pool` would build for `job_variables`.

    This is how the sweep and the cost collector reach the same account, cluster, resource
    group or namespace as the workers, with the credentials block the pool names, and no
    secret passed as a parameter.
    """
    from prefect.client.orchestration import get_client

    async with get_client() as api:
        pool = await api.read_work_pool(work_pool)
        return await config_cls.from_template_and_values(pool.base_job_template, job_variables or {}, client=api)


def pool_job_configuration(config_cls, work_pool: str, job_variables: dict | None = None):
    """`read_pool_job_configuration` from synchronous code."""
    from prefect.utilities.asyncutils import run_coro_as_sync

    return run_coro_as_sync(read_pool_job_configuration(config_cls, work_pool, job_variables))


class CloudAdapter(ABC):
    """A provider's view of one work pool: its account, cluster, resource group or namespace,
    reached with the credentials block the pool names (never a secret passed around)."""

    def __init__(self, work_pool: str, job_variables: dict | None = None):
        self.work_pool = work_pool
        self.job_variables = dict(job_variables or {})

    @abstractmethod
    def intervals(self, run_id: str) -> list[CloudInterval]:
        """Every worker interval of the run the cloud still reports."""

    @abstractmethod
    def stop(self, flow_runs: Iterable) -> list[str]:
        """Stop the infrastructure behind these worker flow runs directly; the resources stopped."""

    @abstractmethod
    def sweep(self, run_id: str) -> list[str]:
        """Stop (or delete) every resource of the run still running; the resources swept."""

    def settle(self, run_id: str, timeout_s: float | None = None) -> list[str]:
        """Wait (at most `timeout_s`, None: the provider's own bound) until the run's workers, told to stop, have stopped, and
        stop what still runs, so the bill that follows reads a stop time for each; the
        resources stopped here. A cloud that records the stop on its own waits for nothing."""
        return []

    def ended(self, infrastructure_pid: str) -> dict | None:
        """What ended the infrastructure behind a flow run Prefect still shows running
        (`{"exit_code", "reason"}`), or None while it runs or where the cloud's own worker
        reports the end. A container killed outright leaves its flow run Running until
        someone looks."""
        return None

    def preflight(self, image: str | None) -> None:
        """Raise `core.errors.ZooidValueError` (naming `target` or `image`) when no worker of
        `image` could start; a cloud whose API only answers with a launch checks nothing here."""

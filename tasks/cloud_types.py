"""The types every cloud module shares: a worker's life on the cloud's clock (`CloudInterval`),
Prefect's flow-run label, and the worker pool's job configuration.

The provider modules (`tasks.cloud_ecs`, `tasks.cloud_aci`, `tasks.cloud_k8s`) build
`CloudInterval`s from their APIs and reach their accounts through `pool_job_configuration`;
`tasks.cloud_runs` prices the intervals and dispatches to the provider modules. All of them
import from here, so the dispatcher depends on the providers and never the other way round.
"""
from __future__ import annotations

from dataclasses import dataclass

FLOW_RUN_ID_LABEL = "prefect.io/flow-run-id"


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

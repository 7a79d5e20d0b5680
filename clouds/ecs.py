"""ECS workers: their cost on AWS's clock, the sweep that stops stragglers, and the task of a flow run.

Every worker task carries the run id as `startedBy` (the work pool template sets it from the
`zooid_run_id` job variable), which is what `ListTasks` can filter on, and as the `zooid-run`
tag. The functions take a boto3 ECS client and a cluster, so they run the same against AWS,
moto or a botocore Stubber; `ecs_session` builds both from the work pool, as a worker would.

Billing follows AWS's rules for Fargate: from the start of the image pull to the task's stop.
A task that stopped without ever starting (`TaskFailedToStart`, no capacity, a bad image) is
a failed placement: listed, not billed. AWS keeps stopped tasks visible for about an hour, so
cost is collected after each epoch, not only at the end of the run.

The provider (`Ecs`): CPU workers run on Fargate, rounded up to the smallest valid Fargate
size (`FARGATE_SIZES`); GPU workers run on an EC2 capacity provider with a
`resourceRequirements` GPU reservation. Its cloud bootstrap points the pool at a cluster and,
from AWS_* variables, an `AwsCredentials` block.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from clouds.adapter import FLOW_RUN_ID_LABEL, CloudAdapter, CloudInterval, pool_job_configuration
from clouds.provider import FLOW_RUN_COMMAND, JobVariablesError, Provider, WorkerResources, run_labels
from clouds.timestamps import epoch_seconds
from core.kinds import Capacity, TargetKind

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
_DESCRIBE_BATCH = 100  # DescribeTasks accepts at most 100 tasks per call
_FAILED_TO_START = ("TaskFailedToStart",)


def ecs_interval(task: dict) -> CloudInterval:
    """One DescribeTasks task as a `CloudInterval`."""
    tags = {t.get("key"): t.get("value") for t in task.get("tags", [])}
    started = epoch_seconds(task.get("startedAt"))
    pull = epoch_seconds(task.get("pullStartedAt"))
    stopped = epoch_seconds(task.get("stoppedAt")) or epoch_seconds(task.get("executionStoppedAt"))
    last = task.get("lastStatus", "")
    if last != "STOPPED":
        status = "running"
    elif started is None and (pull is None or task.get("stopCode") in _FAILED_TO_START):
        status = "failed_placement"
    else:
        codes = [c.get("exitCode") for c in task.get("containers", [])]
        status = "completed" if codes and all(c == 0 for c in codes) else "failed"
    return CloudInterval(resource=task["taskArn"], flow_run_id=tags.get(FLOW_RUN_ID_LABEL),
                         billed_from=pull if pull is not None else started,
                         stopped=stopped if last == "STOPPED" else None, status=status,
                         created=epoch_seconds(task.get("createdAt")), started=started,
                         reason=task.get("stoppedReason", "") or "")


def list_run_tasks(ecs, cluster: str, run_id: str, desired_status: str = "RUNNING") -> list[str]:
    """ARNs of the run's tasks (`startedBy` = run id) with `desired_status` RUNNING or STOPPED."""
    arns: list[str] = []
    for page in ecs.get_paginator("list_tasks").paginate(cluster=cluster, startedBy=run_id,
                                                         desiredStatus=desired_status):
        arns.extend(page.get("taskArns", []))
    return arns


def describe(ecs, cluster: str, task_arns: Iterable[str]) -> list[dict]:
    """DescribeTasks (with tags) in batches of 100."""
    arns = list(task_arns)
    tasks: list[dict] = []
    for i in range(0, len(arns), _DESCRIBE_BATCH):
        resp = ecs.describe_tasks(cluster=cluster, tasks=arns[i:i + _DESCRIBE_BATCH], include=["TAGS"])
        tasks.extend(resp.get("tasks", []))
    return tasks


def run_intervals(ecs, cluster: str, run_id: str) -> list[CloudInterval]:
    """Every task of the run AWS still lists, running or stopped, on AWS's clock."""
    arns = list_run_tasks(ecs, cluster, run_id, "RUNNING") + list_run_tasks(ecs, cluster, run_id, "STOPPED")
    return [ecs_interval(t) for t in describe(ecs, cluster, dict.fromkeys(arns))]


def stop_tasks(ecs, cluster: str, task_arns: Iterable[str], reason: str) -> list[str]:
    """Stop each task; a task already gone is not an error. Returns the ARNs asked to stop."""
    stopped = []
    for arn in task_arns:
        try:
            ecs.stop_task(cluster=cluster, task=arn, reason=reason[:255])
        except ecs.exceptions.InvalidParameterException:
            continue  # already stopped and expired
        stopped.append(arn)
    return stopped


def sweep(ecs, cluster: str, run_id: str, reason: str = "zooid sweep") -> list[str]:
    """Stop every task of the run that is not stopped yet (pending or running)."""
    return stop_tasks(ecs, cluster, list_run_tasks(ecs, cluster, run_id, "RUNNING"), f"{reason}: run {run_id}")


def task_of_flow_run(flow_run) -> tuple[str, str] | None:
    """(cluster, task ARN) of a worker flow run, from its `infrastructure_pid` `cluster::arn`."""
    pid = getattr(flow_run, "infrastructure_pid", None) or ""
    if "::" not in pid:
        return None
    cluster, arn = pid.split("::", 1)
    return cluster, arn


def stop_flow_run_tasks(ecs, flow_runs: Iterable, reason: str = "zooid teardown") -> list[str]:
    """Stop the ECS task behind each flow run directly, without waiting for a worker to see
    the cancellation (a cancelled flow run alone can leave its task running)."""
    stopped = []
    for fr in flow_runs:
        found = task_of_flow_run(fr)
        if found is not None:
            stopped += stop_tasks(ecs, found[0], [found[1]], reason)
    return stopped


def ecs_session(work_pool: str, job_variables: dict | None = None):
    """(ECS client, cluster) as the pool's workers see them (its credentials block, its cluster)."""
    from prefect_aws.workers.ecs_worker import ECSJobConfiguration

    cfg = pool_job_configuration(ECSJobConfiguration, work_pool, job_variables)
    return cfg.aws_credentials.get_client("ecs"), cfg.cluster or "default"


class EcsAdapter(CloudAdapter):
    """ECS (Fargate) behind the adapter interface."""

    def _session(self):
        return ecs_session(self.work_pool, self.job_variables)

    def intervals(self, run_id: str) -> list[CloudInterval]:
        ecs, cluster = self._session()
        return run_intervals(ecs, cluster, run_id)

    def stop(self, flow_runs: Iterable) -> list[str]:
        ecs, _ = self._session()
        return stop_flow_run_tasks(ecs, flow_runs)

    def sweep(self, run_id: str) -> list[str]:
        ecs, cluster = self._session()
        return sweep(ecs, cluster, run_id)


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


def ecs_job_variables(res: WorkerResources, run_id: str, gpu_capacity_provider: str = "zooid-gpu") -> dict:
    """ECS: Fargate for CPU workers, an EC2 capacity provider plus a GPU reservation otherwise; the
    flow run's engine as the container's command (`FLOW_RUN_COMMAND`)."""
    if res.gpu == 0:
        cpu, memory = fargate_size(res.vcpu, res.requested_memory_gb)
        return {"launch_type": "FARGATE", "cpu": cpu, "memory": memory,
                "zooid_run_id": run_id, "labels": run_labels(run_id), "command": FLOW_RUN_COMMAND}
    # On EC2 the container reserves CPU units and MiB on an instance: no Fargate grid to round to.
    return {"launch_type": "EC2",
            "capacity_provider_strategy": [{"capacityProvider": gpu_capacity_provider, "weight": 1, "base": 0}],
            "cpu": math.ceil(res.vcpu * 1024 - 1e-9), "memory": math.ceil(res.requested_memory_gb * 1024 - 1e-9),
            "resource_requirements": [{"type": "GPU", "value": str(res.gpu)}],
            "zooid_run_id": run_id, "labels": run_labels(run_id), "command": FLOW_RUN_COMMAND}


SPOT_STOP_TIMEOUT_S = 120
"""The container's `stopTimeout` on Fargate Spot: the whole two minutes between the interruption's
SIGTERM and the stop (Fargate's default is 30 s, its most 120 s)."""


def fargate_spot(sized: dict) -> dict:
    """A Fargate worker's job variables (`ecs_job_variables`) on Fargate Spot: the capacity
    provider strategy `FARGATE_SPOT` (RunTask then takes no launch type: prefect-aws drops it
    where a strategy is set, and `launch_type` FARGATE_SPOT keeps its Fargate task definition,
    task-level cpu and memory) and a `stopTimeout` of the notice's 120 s. A GPU worker (EC2) has
    no Fargate Spot: JobVariablesError naming `capacity`."""
    if sized.get("launch_type") != "FARGATE":
        raise JobVariablesError("capacity", "spot on ECS is Fargate Spot, for CPU workers; GPU workers run on EC2")
    return {**sized, "launch_type": "FARGATE_SPOT", "stop_timeout": SPOT_STOP_TIMEOUT_S,
            "capacity_provider_strategy": [{"capacityProvider": "FARGATE_SPOT", "weight": 1}]}


class Ecs(Provider):
    """The `ecs` target: ECS tasks (Fargate, or EC2 for GPUs) started by prefect-aws's ECS worker."""

    kind = TargetKind.ECS
    title = "ECS"
    adapter = EcsAdapter
    account_options = {"cluster": "cluster"}
    credentials_variable = "aws_credentials"

    @classmethod
    def size(cls, res: WorkerResources, run_id: str, gpu_capacity_provider: str = "zooid-gpu") -> dict:
        return ecs_job_variables(res, run_id, gpu_capacity_provider)

    @classmethod
    def on_capacity(cls, sized: dict, capacity: str) -> dict:
        """Spot: Fargate Spot (`fargate_spot`); on-demand: as sized."""
        return fargate_spot(sized) if capacity == Capacity.SPOT else super().on_capacity(sized, capacity)

    @classmethod
    def credentials_block(cls, environ: Mapping[str, str]) -> tuple[str, Any] | None:
        """`zooid-aws`, an `AwsCredentials` from AWS_ACCESS_KEY_ID and its companions."""
        if not environ.get("AWS_ACCESS_KEY_ID"):
            return None
        from prefect_aws import AwsCredentials

        return "zooid-aws", AwsCredentials(aws_access_key_id=environ["AWS_ACCESS_KEY_ID"],
                                           aws_secret_access_key=environ.get("AWS_SECRET_ACCESS_KEY"),
                                           region_name=environ.get("AWS_DEFAULT_REGION"))

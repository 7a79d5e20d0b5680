"""ECS workers: their cost on AWS's clock, the sweep that stops stragglers, and the task of a flow run.

Every worker task carries the run id as `startedBy` (the work pool template sets it from the
`zooid_run_id` job variable), which is what `ListTasks` can filter on, and as the `zooid-run`
tag. The functions take a boto3 ECS client and a cluster, so they run the same against AWS,
moto or a botocore Stubber; `ecs_session` builds both from the work pool, as a worker would.

Billing follows AWS's rules for Fargate: from the start of the image pull to the task's stop.
A task that stopped without ever starting (`TaskFailedToStart`, no capacity, a bad image) is
a failed placement: listed, not billed. AWS keeps stopped tasks visible for about an hour, so
cost is collected after each epoch, not only at the end of the run.
"""
from __future__ import annotations

from typing import Iterable

from clouds.adapter import FLOW_RUN_ID_LABEL, CloudAdapter, CloudInterval, pool_job_configuration
from clouds.timestamps import epoch_seconds

RUN_TAG = "zooid-run"
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

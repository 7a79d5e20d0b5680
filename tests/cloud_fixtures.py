"""Helpers for the cloud tests: offline template rendering, in-memory flow runs, and an ECS
DescribeTasks answer. The answer is written for the tests, not recorded from AWS: it is held to
botocore's own ECS model (`tests.provider_schemas.ecs`), so a member, type or enum value AWS
could not send fails here.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from tests.provider_schemas.ecs import check_output

TEMPLATES = Path(__file__).resolve().parents[1] / "deployments" / "templates"


def template(pool_type: str) -> dict:
    """Our base job template for `pool_type` (ecs, azure-container-instance, kubernetes)."""
    return json.loads((TEMPLATES / f"{pool_type}.json").read_text())


def render(config_cls, base_job_template: dict, values: dict):
    """`config_cls.from_template_and_values` without a Prefect server.

    The templates reference no block or Prefect variable, so the client is never called;
    handing one in keeps Prefect from starting a temporary server just to construct it.
    """
    return asyncio.run(render_async(config_cls, base_job_template, values))


async def render_async(config_cls, base_job_template: dict, values: dict):
    """`render` inside a running event loop."""
    from prefect.client.orchestration import PrefectClient

    client = PrefectClient("http://127.0.0.1:9/api")  # never contacted
    return await config_cls.from_template_and_values(base_job_template, values, client=client)


def flow_run(name: str, infrastructure_pid: str | None = None):
    """A worker flow run as the API would return it (only the fields workers read)."""
    from prefect.client.schemas.objects import FlowRun

    return FlowRun(id=uuid.uuid4(), name=name, flow_id=uuid.uuid4(), infrastructure_pid=infrastructure_pid)


# One Fargate worker that ran to completion, one whose image pull failed (never started),
# one still running: DescribeTasks in the shape AWS documents for `include=["TAGS"]` (us-east-1).
ACCOUNT = "123456789012"
CLUSTER_ARN = f"arn:aws:ecs:us-east-1:{ACCOUNT}:cluster/zooid"


def _task(task_id: str, flow_run_id: str, **fields) -> dict:
    arn = f"arn:aws:ecs:us-east-1:{ACCOUNT}:task/zooid/{task_id}"
    base = {
        "attachments": [{"id": "5c1f0c4e-8b0a-4a36-9a57-0d3f2a1b9e11", "type": "ElasticNetworkInterface",
                         "status": "DELETED", "details": [{"name": "subnetId", "value": "subnet-0a1b2c3d"}]}],
        "attributes": [{"name": "ecs.cpu-architecture", "value": "x86_64"}],
        "availabilityZone": "us-east-1a",
        "clusterArn": CLUSTER_ARN,
        "containers": [],
        "cpu": "1024",
        "desiredStatus": "STOPPED",
        "enableExecuteCommand": False,
        "group": "family:prefect_worker",
        "healthStatus": "UNKNOWN",
        "launchType": "FARGATE",
        "memory": "2048",
        "overrides": {"containerOverrides": [{"name": "prefect"}], "inferenceAcceleratorOverrides": []},
        "platformVersion": "1.4.0",
        "platformFamily": "Linux",
        "startedBy": "zrun0001",
        "tags": [{"key": "zooid-run", "value": "zrun0001"}, {"key": "prefect.io/flow-run-id", "value": flow_run_id},
                 {"key": "prefect.io/flow-run-name", "value": "zrun0001-e0-r0-a0"}],
        "taskArn": arn,
        "taskDefinitionArn": f"arn:aws:ecs:us-east-1:{ACCOUNT}:task-definition/prefect_worker:3",
        "version": 5,
        "ephemeralStorage": {"sizeInGiB": 20},
    }
    base.update(fields)
    return base


def _container(task_id: str, status: str, exit_code: int | None = None, reason: str | None = None) -> dict:
    c = {"containerArn": f"arn:aws:ecs:us-east-1:{ACCOUNT}:container/zooid/{task_id}/7f0e",
         "taskArn": f"arn:aws:ecs:us-east-1:{ACCOUNT}:task/zooid/{task_id}", "name": "prefect",
         "image": f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/zooid-worker:cpu-0.1.0",
         "lastStatus": status, "networkInterfaces": [], "healthStatus": "UNKNOWN", "cpu": "0"}
    if exit_code is not None:
        c["exitCode"] = exit_code
    if reason is not None:
        c["reason"] = reason
    return c


def describe_tasks_response(run_ids: tuple[str, str, str]) -> dict:
    """Recorded DescribeTasks: completed (run_ids[0]), failed placement (1), running (2).

    Timestamps are datetimes, as botocore returns them after parsing the wire's epoch seconds;
    the answer is held to botocore's ECS output shape (`tests.provider_schemas.ecs`).
    """
    from datetime import datetime, timezone

    def t(s: float) -> datetime:
        return datetime.fromtimestamp(1_790_000_000 + s, tz=timezone.utc)

    done = _task("0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e", run_ids[0],
                 containers=[_container("0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e", "STOPPED", 0)],
                 lastStatus="STOPPED", connectivity="CONNECTED", connectivityAt=t(2.1),
                 createdAt=t(0.0), pullStartedAt=t(6.5), pullStoppedAt=t(41.2), startedAt=t(44.0),
                 stoppingAt=t(644.0), executionStoppedAt=t(643.7), stoppedAt=t(656.5),
                 stopCode="EssentialContainerExited", stoppedReason="Essential container in task exited")
    never = _task("1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f", run_ids[1],
                  containers=[_container("1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f", "STOPPED",
                                         reason="CannotPullContainerError: pull image manifest has been retried 5 time(s)")],
                  lastStatus="STOPPED", createdAt=t(1.0), stoppingAt=t(70.0), stoppedAt=t(75.0),
                  stopCode="TaskFailedToStart",
                  stoppedReason="CannotPullContainerError: pull image manifest has been retried 5 time(s)")
    running = _task("2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a", run_ids[2], desiredStatus="RUNNING",
                    containers=[_container("2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a", "RUNNING")],
                    lastStatus="RUNNING", connectivity="CONNECTED", connectivityAt=t(2.0),
                    createdAt=t(2.0), pullStartedAt=t(8.0), pullStoppedAt=t(30.0), startedAt=t(33.0))
    return check_output("DescribeTasks", {"tasks": [done, never, running], "failures": []})

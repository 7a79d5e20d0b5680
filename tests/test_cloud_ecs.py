"""ECS workers against moto in server mode (127.0.0.1): the real prefect-aws ECS worker code path
with our rendered template registers and runs tasks; cancel and sweep leave no RUNNING task.
Cost from AWS's clock uses a DescribeTasks answer written for the test through botocore's
Stubber (moto runs no container and reports no startedAt/stoppedAt), held to botocore's ECS
model (`tests.provider_schemas.ecs`), as is the request the code sends.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from clouds import ecs as cloud_ecs
from clouds.provider import WorkerResources
from clouds.registry import job_variables
from tests.cloud_fixtures import describe_tasks_response, flow_run, render, template
from tests.provider_schemas.ecs import check_input

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def aws(s3_server):
    """moto's ECS/EC2/STS on the session's moto server: (endpoint, ecs client, new cluster name)."""
    import boto3

    ecs = boto3.client("ecs", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    return s3_server.endpoint, ecs


def _cluster(ecs) -> str:
    name = f"zooid-{uuid.uuid4().hex[:8]}"
    ecs.create_cluster(clusterName=name)
    return name


def _configuration(endpoint: str, cluster: str, run_id: str, res: WorkerResources):
    from prefect_aws.workers.ecs_worker import ECSJobConfiguration

    creds = {"region_name": "us-east-1", "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
             "aws_client_parameters": {"endpoint_url": endpoint}}
    values = job_variables("ecs", res, run_id, image="zooid-worker:cpu-0.1.0",
                           extra={"cluster": cluster, "aws_credentials": creds, "family": "zooid-worker"})
    return render(ECSJobConfiguration, template("ecs"), values)


def _launch(endpoint: str, cluster: str, run_id: str, ranks: int):
    """Launch `ranks` worker flow runs through ECSWorker.run; return [(flow_run, identifier, config)]."""
    from prefect_aws.workers.ecs_worker import ECSWorker

    worker = ECSWorker(work_pool_name="zooid-ecs")
    out = []
    for rank in range(ranks):
        cfg = _configuration(endpoint, cluster, run_id, WorkerResources(vcpu=1, memory_gb=1.2))
        fr = flow_run(f"{run_id}-e0-r{rank}-a0")
        cfg.prepare_for_flow_run(fr)
        result = asyncio.run(worker.run(fr, cfg))
        out.append((fr.model_copy(update={"infrastructure_pid": result.identifier}), result.identifier, cfg))
    return worker, out


def test_worker_registers_and_runs_tagged_fargate_tasks(aws):
    endpoint, ecs = aws
    cluster = _cluster(ecs)
    _, launched = _launch(endpoint, cluster, "zrunaaaa", ranks=2)

    arns = cloud_ecs.list_run_tasks(ecs, cluster, "zrunaaaa")
    assert sorted(arns) == sorted(ident.split("::", 1)[1] for _, ident, _ in launched)
    tasks = cloud_ecs.describe(ecs, cluster, arns)
    for task, (fr, _, _) in zip(sorted(tasks, key=lambda t: t["taskArn"]),
                                sorted(launched, key=lambda x: x[1])):
        tags = {t["key"]: t["value"] for t in task["tags"]}
        assert task["startedBy"] == "zrunaaaa"
        assert tags["zooid-run"] == "zrunaaaa"
        assert cloud_ecs.ecs_interval(task).flow_run_id in {str(f.id) for f, _, _ in launched}
        assert task["launchType"] == "FARGATE"
    taskdef = ecs.describe_task_definition(taskDefinition=tasks[0]["taskDefinitionArn"])["taskDefinition"]
    # 1.2 GB profiled * 1.25 + 1 GB = 2.5 GB: 3 GB is the smallest Fargate size with 1 vCPU that holds it.
    assert (taskdef["cpu"], taskdef["memory"]) == ("1024", "3072")
    assert "FARGATE" in taskdef["requiresCompatibilities"]
    assert taskdef["containerDefinitions"][0]["image"] == "zooid-worker:cpu-0.1.0"
    assert "resourceRequirements" not in taskdef["containerDefinitions"][0]


def test_cancelled_run_leaves_no_running_task(aws):
    endpoint, ecs = aws
    cluster = _cluster(ecs)
    worker, launched = _launch(endpoint, cluster, "zrunbbbb", ranks=3)
    other_worker, other = _launch(endpoint, cluster, "zrunother", ranks=1)
    assert len(cloud_ecs.list_run_tasks(ecs, cluster, "zrunbbbb")) == 3

    # The worker's own kill path for one flow run, Zooid's direct stop for the rest.
    fr0, ident0, cfg0 = launched[0]
    asyncio.run(worker.kill_infrastructure(ident0, cfg0))
    stopped = cloud_ecs.stop_flow_run_tasks(ecs, [fr for fr, _, _ in launched[1:]])

    assert len(stopped) == 2
    assert cloud_ecs.list_run_tasks(ecs, cluster, "zrunbbbb", "RUNNING") == []
    assert len(cloud_ecs.list_run_tasks(ecs, cluster, "zrunbbbb", "STOPPED")) == 3
    assert len(cloud_ecs.list_run_tasks(ecs, cluster, "zrunother", "RUNNING")) == 1


def test_crash_then_sweep_leaves_no_running_task(aws):
    endpoint, ecs = aws
    cluster = _cluster(ecs)
    _launch(endpoint, cluster, "zruncccc", ranks=2)  # the coordinator "crashes": handles are lost
    _launch(endpoint, cluster, "zrunkeep", ranks=1)

    swept = cloud_ecs.sweep(ecs, cluster, "zruncccc")

    assert len(swept) == 2
    assert cloud_ecs.list_run_tasks(ecs, cluster, "zruncccc", "RUNNING") == []
    assert cloud_ecs.sweep(ecs, cluster, "zruncccc") == []  # idempotent
    assert len(cloud_ecs.list_run_tasks(ecs, cluster, "zrunkeep", "RUNNING")) == 1
    reasons = {t["stoppedReason"] for t in cloud_ecs.describe(
        ecs, cluster, cloud_ecs.list_run_tasks(ecs, cluster, "zruncccc", "STOPPED"))}
    assert reasons == {"zooid sweep: run zruncccc"}


def test_gpu_worker_registers_gpu_reservation_on_ec2_capacity_provider(aws):
    endpoint, ecs = aws
    from prefect_aws.workers.ecs_worker import ECSWorker

    cfg = _configuration(endpoint, "zooid-gpu-cluster", "zrungpu",
                         WorkerResources(vcpu=4, memory_gb=10, gpu=1, gpu_type="T4"))
    assert cfg.task_run_request["capacityProviderStrategy"] == [
        {"capacityProvider": "zooid-gpu", "weight": 1, "base": 0}]
    fr = flow_run("zrungpu-e0-r0-a0")
    cfg.prepare_for_flow_run(fr)
    worker = ECSWorker(work_pool_name="zooid-ecs")
    taskdef = worker._prepare_task_definition(cfg, region="us-east-1", flow_run=fr)
    arn, _ = worker._get_or_register_task_definition(logging.getLogger("test"), ecs, cfg, fr, taskdef)
    registered = ecs.describe_task_definition(taskDefinition=arn)["taskDefinition"]
    container = registered["containerDefinitions"][0]
    assert container["resourceRequirements"] == [{"type": "GPU", "value": "1"}]
    # EC2 reservations: 4 vCPU = 4096 units, 10 GB * 1.25 + 1 GB = 13.5 GB = 13824 MiB.
    assert (container["cpu"], container["memory"]) == (4096, 13824)
    request = worker._prepare_task_run_request(cfg, registered, arn, True)
    assert "launchType" not in request and request["startedBy"] == "zrungpu"


def test_cost_from_describe_tasks_clock():
    import boto3
    from botocore.stub import Stubber

    from coordinator.bill.cloud_bill import cloud_records
    from planners.catalog import get_offer

    ids = (str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4()))
    ecs = boto3.client("ecs", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    response = describe_tasks_response(ids)
    arns = [t["taskArn"] for t in response["tasks"]]
    with Stubber(ecs) as stub:
        expected = check_input("DescribeTasks", {"cluster": "zooid", "tasks": arns, "include": ["TAGS"]})
        stub.add_response("describe_tasks", response, expected)
        intervals = [cloud_ecs.ecs_interval(t) for t in cloud_ecs.describe(ecs, "zooid", arns)]
        stub.assert_no_pending_responses()

    assert [i.status for i in intervals] == ["completed", "failed_placement", "running"]
    assert intervals[0].startup_s == pytest.approx(44.0)
    offer = get_offer("fargate-cpu")
    price = offer.price_per_s(1, 2, 0)
    now = 1_790_000_000 + 100.0
    attempts = {ids[0]: (0, 0, 0), ids[1]: (0, 1, 0), ids[2]: (0, 1, 1)}
    rows = cloud_records("zrun0001", intervals, attempts, offer, price, now=now)

    done, never, running = rows
    # Billed from the image pull (6.5 s) to the stop (656.5 s): 650 s at 1 vCPU + 2 GB.
    assert (done.kind, done.seconds) == ("worker", pytest.approx(650.0))
    assert done.usd == pytest.approx(650.0 * (0.04048 + 2 * 0.004445) / 3600)
    assert (never.kind, never.usd, never.rank, never.attempt) == ("failed_placement", 0.0, 1, 0)
    assert (running.kind, running.seconds, running.attempt) == ("worker", pytest.approx(92.0), 1)
    assert running.status == "running"

"""ACI workers: our template renders through the real worker configuration with the GPU request
in the ARM template; create (the ACI worker's own provisioning code), cancel, sweep and cost run
through the Azure SDK clients against a fake HTTP transport that answers as Azure Resource
Manager documents it. The answers are written for the tests, not recorded from Azure: every one
is held to the Azure SDK's models (`tests.provider_schemas.aci`), and so is the container group
in the ARM template the ACI worker deploys.
"""
from __future__ import annotations

import asyncio
import io
import json
import re
import uuid
from dataclasses import dataclass, field

import pytest
import requests
import urllib3

from clouds import aci as cloud_aci
from clouds.provider import WorkerResources
from clouds.registry import job_variables
from tests.cloud_fixtures import flow_run, render, template
from tests.provider_schemas import aci as schemas

pytestmark = pytest.mark.timeout(60)

SUB = "00000000-1111-2222-3333-444444444444"
RG = "zooid-rg"
BASE = f"/subscriptions/{SUB}/resourcegroups/{RG}"


def _group(name: str, run_id: str, state: str, *, started: str | None, finished: str | None = None,
           exit_code: int | None = None, provisioning: str = "Succeeded", pulled: bool = True,
           gpu: bool = True) -> dict:
    """A container group as ACI's GET answers it (api-version 2023-05-01), with instance view."""
    events = []
    if pulled:
        events += [{"count": 1, "firstTimestamp": "2026-11-20T10:00:05Z", "lastTimestamp": "2026-11-20T10:00:05Z",
                    "name": "Pulling", "message": "pulling image \"zooid.azurecr.io/zooid-worker:cuda-0.1.0\"",
                    "type": "Normal"},
                   {"count": 1, "firstTimestamp": "2026-11-20T10:01:45Z", "lastTimestamp": "2026-11-20T10:01:45Z",
                    "name": "Pulled", "message": "Successfully pulled image", "type": "Normal"}]
    if started:
        events.append({"count": 1, "firstTimestamp": started, "lastTimestamp": started, "name": "Started",
                       "message": "Started container", "type": "Normal"})
    current = {"state": state, "detailStatus": "Completed" if state == "Terminated" else ""}
    if started:
        current["startTime"] = started
    if finished:
        current["finishTime"] = finished
    if exit_code is not None:
        current["exitCode"] = exit_code
    requests_ = {"memoryInGB": 7.5, "cpu": 4.0}
    if gpu:
        requests_["gpu"] = {"count": 1, "sku": "K80"}
    return {
        "id": f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.ContainerInstance/containerGroups/{name}",
        "location": "eastus", "name": name, "tags": {"zooid-run": run_id},
        "type": "Microsoft.ContainerInstance/containerGroups",
        "properties": {
            "sku": "Standard", "provisioningState": provisioning, "restartPolicy": "Never", "osType": "Linux",
            "containers": [{"name": "worker", "properties": {
                "image": "zooid.azurecr.io/zooid-worker:cuda-0.1.0", "command": ["prefect", "flow-run", "execute"],
                "ports": [], "environmentVariables": [], "resources": {"requests": requests_},
                "instanceView": {"restartCount": 0, "currentState": current, "events": events}}}],
            "initContainers": [], "instanceView": {"events": [], "state": "Succeeded" if started else "Pending"}},
    }


def _listed(group: dict) -> dict:
    """A container group as ACI's list answers it: without instance views (only a GET of the
    group carries them, which is why `clouds.aci.run_intervals` reads each group)."""
    props = {k: v for k, v in group["properties"].items() if k != "instanceView"}
    props["containers"] = [{**c, "properties": {k: v for k, v in c["properties"].items() if k != "instanceView"}}
                           for c in props["containers"]]
    return {**group, "properties": props}


@dataclass
class FakeArm(requests.adapters.BaseAdapter):
    """Azure Resource Manager at the HTTP boundary: container groups in a dict, requests recorded,
    every answer held to the Azure SDK's models before the client sees it."""

    groups: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def _reply(self, request, status: int, body=None, model=None) -> requests.Response:
        """The answer, held to the Azure SDK's `model` (an error to ARM's error envelope)."""
        if body is not None:
            schemas.check_error(body) if status >= 400 else schemas.check(model, body)
        resp = requests.Response()
        resp.status_code, resp.request, resp.url = status, request, request.url
        resp.headers["Content-Type"] = "application/json"
        resp._content = json.dumps(body).encode() if body is not None else b""
        resp.raw = urllib3.response.HTTPResponse(body=io.BytesIO(resp._content), status=status,
                                                 preload_content=False)
        return resp

    def send(self, request, **kwargs):
        path = requests.utils.urlparse(request.url).path
        low = path.lower()
        self.calls.append((request.method, path, json.loads(request.body) if request.body else None))
        m = re.search(r"/containergroups/([^/]+)(/stop)?$", low)
        if request.method == "PUT" and "/microsoft.resources/deployments/" in low:
            body = json.loads(request.body)
            name = body["properties"]["parameters"]["container_group_name"]["value"]
            [resource] = body["properties"]["template"]["resources"]
            schemas.check_template_group(resource)
            run_id = resource["tags"]["zooid-run"]
            self.groups[name] = _group(name, run_id, "Running", started="2026-11-20T10:01:50Z")
            return self._reply(request, 200, {"id": path, "name": path.rsplit("/", 1)[-1],
                                              "type": "Microsoft.Resources/deployments",
                                              "properties": {"provisioningState": "Succeeded", "mode": "Incremental"}},
                               schemas.DEPLOYMENT)
        if request.method == "GET" and low.endswith("/containergroups"):
            return self._reply(request, 200, {"value": [_listed(g) for g in self.groups.values()]},
                               schemas.CONTAINER_GROUP_LIST)
        if m and request.method == "POST" and m.group(2):
            name = path.rsplit("/", 2)[-2]
            if name not in self.groups:
                return self._reply(request, 404, {"error": {"code": "ResourceNotFound", "message": name}})
            g = self.groups[name]["properties"]["containers"][0]["properties"]["instanceView"]["currentState"]
            g.update(state="Terminated", finishTime="2026-11-20T10:03:00Z", exitCode=137, detailStatus="Killed")
            return self._reply(request, 204)
        if m and request.method in ("GET", "DELETE"):
            name = path.rsplit("/", 1)[-1]
            if name not in self.groups:
                return self._reply(request, 404 if request.method == "GET" else 204,
                                   {"error": {"code": "ResourceNotFound", "message": name}}
                                   if request.method == "GET" else None)
            group = self.groups[name] if request.method == "GET" else self.groups.pop(name)
            return self._reply(request, 200, group, schemas.CONTAINER_GROUP)
        return self._reply(request, 400, {"error": {"code": "Unexpected", "message": f"{request.method} {path}"}})

    def close(self):
        pass


class FakeToken:
    """A token credential (what azure-identity returns, without a tenant)."""

    def get_token(self, *scopes, **kwargs):
        from azure.core.credentials import AccessToken

        return AccessToken("fake-token", 4_102_444_800)


def _clients(arm: FakeArm):
    from azure.core.pipeline.transport import RequestsTransport
    from azure.mgmt.containerinstance import ContainerInstanceManagementClient
    from azure.mgmt.resource import ResourceManagementClient

    session = requests.Session()
    session.mount("https://", arm)
    aci = ContainerInstanceManagementClient(FakeToken(), SUB, transport=RequestsTransport(session=session),
                                            polling_interval=0)
    session2 = requests.Session()
    session2.mount("https://", arm)
    resources = ResourceManagementClient(FakeToken(), SUB, transport=RequestsTransport(session=session2),
                                         polling_interval=0)
    return aci, resources


def _configuration(run_id: str, res: WorkerResources):
    from prefect_azure.workers.container_instance import AzureContainerJobConfiguration

    values = job_variables("aci", res, run_id, image="zooid.azurecr.io/zooid-worker:cuda-0.1.0",
                           extra={"resource_group_name": RG, "subscription_id": SUB,
                                  "task_watch_poll_interval": 0.01})
    return render(AzureContainerJobConfiguration, template("azure-container-instance"), values)


def _create(arm: FakeArm, run_id: str, rank: int, res: WorkerResources):
    """Create one worker's container group through the ACI worker's own provisioning code."""
    from prefect_azure.workers.container_instance import AzureContainerWorker

    aci, resources = _clients(arm)
    cfg = _configuration(run_id, res)
    fr = flow_run(f"{run_id}-e0-r{rank}-a0")
    cfg.prepare_for_flow_run(fr)
    name = f"worker-{fr.id}"
    worker = AzureContainerWorker(work_pool_name="zooid-aci")
    group = asyncio.run(worker._provision_container_group(aci, resources, cfg, name))
    return fr.model_copy(update={"infrastructure_pid": f"{fr.id}:{group.name}"}), cfg


def test_gpu_worker_arm_template_carries_gpu_and_run_tag():
    cfg = _configuration("zrunacia", WorkerResources(vcpu=4, memory_gb=5.6, gpu=1, gpu_type="K80"))
    group = cfg.arm_template["resources"][0]
    requests_ = group["properties"]["containers"][0]["properties"]["resources"]["requests"]
    # 5.6 GB * 1.25 + 1 GB = 8 GB
    assert requests_ == {"cpu": 4.0, "memoryInGB": 8.0, "gpu": {"count": 1, "sku": "K80"}}
    assert group["tags"] == {"zooid-run": "zrunacia"}
    assert cfg.keep_container_group is True


def test_cpu_worker_arm_template_has_no_gpu_field():
    cfg = _configuration("zrunacib", WorkerResources(vcpu=1, memory_gb=1.0))
    requests_ = cfg.arm_template["resources"][0]["properties"]["containers"][0]["properties"]["resources"]["requests"]
    assert requests_ == {"cpu": 1.0, "memoryInGB": 2.3}


def test_create_cancel_and_sweep_through_the_sdk():
    arm = FakeArm()
    res = WorkerResources(vcpu=4, memory_gb=5.6, gpu=1, gpu_type="K80")
    launched = [_create(arm, "zrunacic", rank, res) for rank in range(3)]
    _create(arm, "zrunother", 0, res)
    aci, _ = _clients(arm)

    deployment = next(body for method, path, body in arm.calls if method == "PUT")
    sent = deployment["properties"]["template"]["resources"][0]
    assert sent["properties"]["containers"][0]["properties"]["resources"]["requests"]["gpu"] == {"count": 1, "sku": "K80"}
    assert sorted(cloud_aci.list_run_groups(aci, RG, "zrunacic")) == sorted(
        cloud_aci.group_of_flow_run(fr) for fr, _ in launched)

    # Cancel: stop rank 0's group directly from its flow run's infrastructure pid.
    assert cloud_aci.stop_flow_run_groups(aci, RG, [launched[0][0]]) == [cloud_aci.group_of_flow_run(launched[0][0])]
    states = {iv.resource: iv.status for iv in cloud_aci.run_intervals(aci, RG, "zrunacic")}
    assert sorted(states.values()) == ["failed", "running", "running"]

    # Crash, then the sweep: every group of the run is deleted, the other run's is kept.
    swept = cloud_aci.sweep(aci, RG, "zrunacic")
    assert len(swept) == 3
    assert cloud_aci.list_run_groups(aci, RG, "zrunacic") == []
    assert len(cloud_aci.list_run_groups(aci, RG, "zrunother")) == 1
    assert cloud_aci.sweep(aci, RG, "zrunacic") == []


def test_cost_from_container_group_events():
    from coordinator.bill.cloud_bill import cloud_records
    from planners.catalog import get_offer

    ids = [str(uuid.uuid4()) for _ in range(3)]
    arm = FakeArm()
    arm.groups = {
        f"worker-{ids[0]}": _group(f"worker-{ids[0]}", "zrunacid", "Terminated", started="2026-11-20T10:01:50Z",
                                   finished="2026-11-20T10:11:05Z", exit_code=0),
        f"worker-{ids[1]}": _group(f"worker-{ids[1]}", "zrunacid", "Waiting", started=None, pulled=False,
                                   provisioning="Failed"),
        f"worker-{ids[2]}": _group(f"worker-{ids[2]}", "zrunacid", "Terminated", started="2026-11-20T10:01:50Z",
                                   finished="2026-11-20T10:02:05Z", exit_code=1),
    }
    aci, _ = _clients(arm)
    intervals = sorted(cloud_aci.run_intervals(aci, RG, "zrunacid"), key=lambda i: ids.index(i.flow_run_id))
    assert [i.status for i in intervals] == ["completed", "failed_placement", "failed"]
    assert intervals[0].startup_s == pytest.approx(105.0)  # pull start 10:00:05 -> started 10:01:50

    offer = get_offer("aci-gpu-k80")
    price = offer.price_per_s(4, 6, 1)  # 4 x 0.03165 + 6 x 0.00425 + 0.36 = $0.5121/hour
    rows = cloud_records("zrunacid", intervals, {ids[0]: (1, 0, 0), ids[1]: (1, 1, 0), ids[2]: (1, 1, 1)},
                         offer, price)
    done, never, failed = rows
    assert price * 3600 == pytest.approx(0.5121)
    # Billed from the first pull (10:00:05) to termination (10:11:05): 660 s.
    assert (done.kind, done.seconds, done.usd) == ("worker", pytest.approx(660.0), pytest.approx(660 * 0.5121 / 3600))
    assert (never.kind, never.usd, never.rank) == ("failed_placement", 0.0, 1)
    assert (failed.kind, failed.seconds, failed.attempt) == ("failed_attempt", pytest.approx(120.0), 1)

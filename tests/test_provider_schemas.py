"""The checkers that hold the cloud fakes to the providers' SDK schemas (`tests.provider_schemas`)
refuse what each provider could not send: a member its model lacks, a value of the wrong type, a
missing required member, a value outside an enum, a malformed time; and they pass the documents
the fakes answer with. Each finding the checkers made in the fakes is pinned here as well.
"""
from __future__ import annotations

import copy
import uuid
from datetime import UTC, datetime

import pytest

from tests.cloud_fixtures import describe_tasks_response
from tests.provider_schemas import SchemaError, aci, ecs, k8s
from tests.test_cloud_aci import _group
from tests.test_cloud_k8s import _pod


def _tasks() -> dict:
    return describe_tasks_response(tuple(str(uuid.uuid4()) for _ in range(3)))


def _container_group() -> dict:
    return _group("worker-1", "zrun", "Terminated", started="2026-11-20T10:01:50Z",
                  finished="2026-11-20T10:11:05Z", exit_code=0)


def _running_pod() -> dict:
    return _pod("p", {"zooid-run": "zrun"}, "Running", start="2026-11-20T10:00:02Z", started="2026-11-20T10:00:40Z")


def _set(path: tuple, value):
    def change(doc):
        *parents, last = path
        for p in parents:
            doc = doc[p]
        doc[last] = value
    return change


def _drop(path: tuple):
    def change(doc):
        *parents, last = path
        for p in parents:
            doc = doc[p]
        del doc[last]
    return change


_STATE = ("properties", "containers", 0, "properties", "instanceView", "currentState")
_STATUS = ("status", "containerStatuses", 0)

CASES = {
    # name: (check, a good document, a change, a phrase the refusal names)
    "ecs unknown member": (lambda d: ecs.check_output("DescribeTasks", d), _tasks,
                           _set(("tasks", 0, "billedSeconds"), 3), "tasks[0].billedSeconds: not a member of Task"),
    "ecs wrong type": (lambda d: ecs.check_output("DescribeTasks", d), _tasks,
                       _set(("tasks", 0, "version"), "5"), "tasks[0].version: long"),
    "ecs enum": (lambda d: ecs.check_output("DescribeTasks", d), _tasks,
                 _set(("tasks", 0, "stopCode"), "ImagePullFailed"), "'ImagePullFailed' is not one of TaskStopCode"),
    "ecs timestamp parsed": (lambda d: ecs.check_output("DescribeTasks", d), _tasks,
                             _set(("tasks", 0, "startedAt"), 1_790_000_044.0), "tasks[0].startedAt: timestamp"),
    "ecs timestamp on the wire": (lambda d: ecs.check_output("DescribeTasks", d, wire=True),
                                  lambda: {"tasks": [{"taskArn": "a", "startedAt": 1.5}]},
                                  _set(("tasks", 0, "startedAt"), "2026-11-20T10:00:00Z"), "startedAt: timestamp"),
    "ecs required": (lambda d: ecs.check_output("DescribeTasks", d),
                     lambda: {"tasks": [{"taskArn": "a", "tags": [{"key": "k", "value": "v"}],
                                         "attributes": [{"name": "ecs.cpu-architecture"}]}]},
                     _drop(("tasks", 0, "attributes", 0, "name")), "name: required by Attribute"),
    "ecs error type": (lambda d: ecs.check_error("StopTask", d),
                       lambda: {"__type": "InvalidParameterException", "message": "not found"},
                       _set(("__type",), "TaskNotFoundException"), "is not one of"),
    "aci unknown member": (lambda d: aci.check(aci.CONTAINER_GROUP, d), _container_group,
                           _set(("properties", "billedFrom"), "x"), "properties.billedFrom: not a member of ContainerGroup"),
    "aci wrong type": (lambda d: aci.check(aci.CONTAINER_GROUP, d), _container_group,
                       _set(_STATE + ("exitCode",), "0"), "currentState.exitCode: int"),
    "aci required": (lambda d: aci.check(aci.CONTAINER_GROUP, d), _container_group,
                     _drop(("properties", "osType")), "properties.osType required by ContainerGroup"),
    "aci enum": (lambda d: aci.check(aci.CONTAINER_GROUP, d), _container_group,
                 _set(("properties", "containers", 0, "properties", "resources", "requests", "gpu", "sku"), "T4"),
                 "'T4' is not one of ['K80', 'P100', 'V100']"),
    "aci time": (lambda d: aci.check(aci.CONTAINER_GROUP, d), _container_group,
                 _set(_STATE + ("startTime",), "10:01:50"), "startTime: an ISO-8601 time"),
    "aci error envelope": (aci.check_error, lambda: {"error": {"code": "ResourceNotFound", "message": "x"}},
                           _set(("error", "status"), 404), "CloudErrorBody.status: not a member of CloudErrorBody"),
    "k8s unknown member": (lambda d: k8s.check("V1Pod", d), _running_pod,
                           _set(("status", "billedFrom"), "x"), "status.billedFrom: not a member of V1PodStatus"),
    "k8s wrong type": (lambda d: k8s.check("V1Pod", d), _running_pod,
                       _set(_STATUS + ("restartCount",), "0"), "restartCount: int"),
    "k8s required": (lambda d: k8s.check("V1Pod", d), _running_pod,
                     _drop(_STATUS + ("imageID",)), "`image_id`, must not be `None`"),
    "k8s time": (lambda d: k8s.check("V1Pod", d), _running_pod,
                 _set(("status", "startTime"), "2026-11-20 10:00:02"), "status.startTime: datetime"),
    "k8s kind": (lambda d: k8s.check("V1Pod", d), _running_pod, _set(("kind",), "Job"), "'Job', not 'Pod'"),
    "k8s quantity": (lambda d: k8s.check("V1ResourceRequirements", d), lambda: {"limits": {"nvidia.com/gpu": "1"}},
                     _set(("limits", "nvidia.com/gpu"), 1), "limits['nvidia.com/gpu']: str, got int"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_document_the_provider_could_not_send_is_refused(name):
    check, good, change, phrase = CASES[name]
    doc = good()
    assert check(doc) is doc  # the good document passes, unchanged
    bad = copy.deepcopy(doc)
    change(bad)

    with pytest.raises(SchemaError) as refused:
        check(bad)
    assert phrase in str(refused.value)


def test_an_ecs_request_goes_through_botocores_input_validation():
    params = {"cluster": "zooid", "tasks": ["arn"], "include": ["TAGS"]}
    assert ecs.check_input("DescribeTasks", params) is params
    with pytest.raises(SchemaError, match="Unknown parameter in input: \"startedBy\""):
        ecs.check_input("DescribeTasks", {**params, "startedBy": "zrun"})
    with pytest.raises(SchemaError, match="Missing required parameter"):
        ecs.check_input("StopTask", {"cluster": "zooid"})


def test_the_ecs_fixture_is_a_parsed_answer():
    """`describe_tasks_response` is what botocore returns after parsing: aware datetimes."""
    task = _tasks()["tasks"][0]
    assert task["createdAt"] == datetime.fromtimestamp(1_790_000_000, tz=UTC)


def test_finding_a_pod_delete_answers_the_pod_not_a_status():
    """The Kubernetes fake answered a pod's DELETE with a Status; the client reads a V1Pod there."""
    status = {"apiVersion": "v1", "kind": "Status", "status": "Success",
              "details": {"name": "p", "kind": "pods", "uid": "u"}}
    assert k8s.check("V1Status", status) is status
    with pytest.raises(SchemaError, match="'Status', not 'Pod'"):
        k8s.check("V1Pod", status)


def test_finding_completions_belong_to_the_job_spec():
    """prefect-kubernetes' default template (which Zooid's copied) set `completions` and
    `parallelism` on the pod spec, which has neither."""
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
           "spec": {"template": {"spec": {"completions": 1, "parallelism": 1,
                                          "containers": [{"name": "c", "image": "i"}]}}}}
    with pytest.raises(SchemaError) as refused:
        k8s.check("V1Job", job)
    assert refused.value.problems == ["V1Job.spec.template.spec.completions: not a member of V1PodSpec",
                                      "V1Job.spec.template.spec.parallelism: not a member of V1PodSpec"]
    fixed = copy.deepcopy(job)
    fixed["spec"].update(completions=1, parallelism=1)
    for key in ("completions", "parallelism"):
        del fixed["spec"]["template"]["spec"][key]
    assert k8s.check("V1Job", fixed) is fixed


def test_a_container_group_list_carries_no_instance_view():
    """The ACI fake's list answers as ACI's does: the groups without their instance views."""
    from tests.test_cloud_aci import _listed

    listed = aci.check(aci.CONTAINER_GROUP_LIST, {"value": [_listed(_container_group())]})
    container = listed["value"][0]["properties"]["containers"][0]["properties"]
    assert "instanceView" not in container and "instanceView" not in listed["value"][0]["properties"]

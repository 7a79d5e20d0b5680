"""Job variables from a worker's size, and our templates derived from each worker's real default."""
from __future__ import annotations

import json

import pytest

from clouds.ecs import fargate_size
from clouds.provider import JobVariablesError, WorkerResources
from clouds.registry import job_variables
from tests.cloud_fixtures import template


@pytest.mark.parametrize("pool_type, module, cls", [
    ("ecs", "prefect_aws.workers.ecs_worker", "ECSWorker"),
    ("azure-container-instance", "prefect_azure.workers.container_instance", "AzureContainerWorker"),
    ("kubernetes", "prefect_kubernetes.worker", "KubernetesWorker")])
def test_templates_extend_the_worker_default(pool_type, module, cls):
    import importlib

    default = getattr(importlib.import_module(module), cls).get_default_base_job_template()
    ours = template(pool_type)
    # ACI: one `gpu` object ({count, sku}) in the container's ARM requests replaces the worker's
    # gpu_count / gpu_sku variables and the configuration fields it never reads
    replaced = {"gpu_count", "gpu_sku"} if pool_type == "azure-container-instance" else set()
    assert set(default["variables"]["properties"]) - replaced <= set(ours["variables"]["properties"])
    assert set(default["job_configuration"]) - replaced <= set(ours["job_configuration"])
    for name, prop in ours["variables"]["properties"].items():
        assert prop.get("title") and prop.get("description"), name  # the UI form labels every field
    assert "zooid_run_id" in ours["variables"]["properties"]
    assert "{{ zooid_run_id }}" in json.dumps(ours["job_configuration"])


def test_fargate_size_rounds_up_to_a_valid_pair():
    assert fargate_size(0.25, 0.5) == (256, 512)
    assert fargate_size(1, 2.01) == (1024, 3072)
    assert fargate_size(1, 9) == (2048, 9216)  # 1 vCPU tops out at 8 GB
    assert fargate_size(5, 17) == (8192, 20480)
    with pytest.raises(JobVariablesError, match="memory_gb"):
        fargate_size(16, 121)


def test_memory_is_profiled_peak_plus_headroom_and_extra_never_overrides_size():
    res = WorkerResources(vcpu=2, memory_gb=2.0)
    assert res.requested_memory_gb == 3.5
    jv = job_variables("ecs", res, "zrun", extra={"cpu": 256, "cluster": "c", "env": {"A": "1"}},
                       env={"B": "2"})
    assert (jv["cpu"], jv["memory"], jv["cluster"], jv["env"]) == (2048, 4096, "c", {"A": "1", "B": "2"})
    assert jv["labels"] == {"zooid-run": "zrun"} and jv["zooid_run_id"] == "zrun"


def test_bad_sizes_name_the_parameter():
    with pytest.raises(JobVariablesError, match="gpu_type"):
        WorkerResources(vcpu=1, memory_gb=1, gpu=1)
    with pytest.raises(JobVariablesError, match="vcpu"):
        WorkerResources(vcpu=0, memory_gb=1)
    with pytest.raises(JobVariablesError, match="gpu_type"):
        job_variables("aci", WorkerResources(vcpu=1, memory_gb=1, gpu=1, gpu_type="A100"), "zrun")
    with pytest.raises(JobVariablesError, match="kind"):
        job_variables("lambda", WorkerResources(vcpu=1, memory_gb=1), "zrun")

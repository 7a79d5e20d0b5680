"""Kubernetes workers: our template renders through the real worker configuration with an
`nvidia.com/gpu` limit in the pod; create (the Kubernetes worker's own job creation, through its
own client from a cluster-config block), cancel, sweep and cost run through kubernetes_asyncio
against a fake API server on 127.0.0.1 that answers with recorded API objects.
"""
from __future__ import annotations

import asyncio
import itertools
import uuid

import pytest

from clouds import kubernetes as cloud_k8s
from clouds.provider import WorkerResources
from clouds.registry import job_variables
from tests.cloud_fixtures import flow_run, render, render_async, template

pytestmark = pytest.mark.timeout(60)
NS = "zooid"


def _pod(name: str, labels: dict, phase: str, *, start: str | None, started: str | None = None,
         finished: str | None = None, exit_code: int | None = None, unschedulable: bool = False) -> dict:
    """A pod as the API returns it (v1), trimmed of fields nothing reads."""
    if finished:
        state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                "startedAt": started, "finishedAt": finished,
                                "containerID": "containerd://5d1c"}}
    elif started:
        state = {"running": {"startedAt": started}}
    else:
        state = {"waiting": {"reason": "ContainerCreating"}}
    conditions = ([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "lastTransitionTime": "2026-11-20T10:00:00Z",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]
                  if unschedulable else
                  [{"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-20T10:00:00Z"}])
    status = {"phase": phase, "conditions": conditions, "qosClass": "Guaranteed"}
    if start:
        status["startTime"] = start
        status["containerStatuses"] = [{"name": "prefect-job", "ready": False, "restartCount": 0,
                                        "image": "zooid-worker:cuda-0.1.0", "imageID": "", "state": state}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels, "uid": str(uuid.uuid4()),
                         "creationTimestamp": "2026-11-20T10:00:00Z"},
            "spec": {"containers": [{"name": "prefect-job", "image": "zooid-worker:cuda-0.1.0"}]},
            "status": status}


class FakeKubernetes:
    """The Kubernetes API at the HTTP boundary: Jobs and pods in dicts, requests recorded."""

    def __init__(self):
        self.jobs: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self._n = itertools.count()

    @staticmethod
    def _match(labels: dict, selector: str | None) -> bool:
        pairs = [p.split("=", 1) for p in (selector or "").split(",") if p]
        return all(labels.get(k) == v for k, v in pairs)

    def app(self):
        from aiohttp import web

        async def create_job(request):
            job = await request.json()
            name = job["metadata"]["generateName"] + f"x{next(self._n)}"
            job["metadata"].update(name=name, uid=str(uuid.uuid4()), creationTimestamp="2026-11-20T10:00:00Z")
            self.jobs[name] = job
            pod_labels = {**job["spec"]["template"]["metadata"]["labels"], "job-name": name}
            self.pods[name + "-p"] = _pod(name + "-p", pod_labels, "Running", start="2026-11-20T10:00:02Z",
                                          started="2026-11-20T10:00:40Z")
            return web.json_response(job, status=201)

        async def list_kind(request):
            kind = request.match_info["kind"]
            store = self.jobs if kind == "jobs" else self.pods
            items = [o for o in store.values()
                     if self._match(o["metadata"].get("labels", {}), request.query.get("labelSelector"))]
            return web.json_response({"apiVersion": "batch/v1" if kind == "jobs" else "v1",
                                      "kind": "JobList" if kind == "jobs" else "PodList",
                                      "metadata": {"resourceVersion": "1"}, "items": items})

        async def delete(request):
            kind, name = request.match_info["kind"], request.match_info["name"]
            store = self.jobs if kind == "jobs" else self.pods
            if name not in store:
                return web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                          "reason": "NotFound", "code": 404,
                                          "message": f'{kind} "{name}" not found'}, status=404)
            obj = store.pop(name)
            if kind == "jobs":  # background propagation removes the Job's pods
                for pod in [p for p, v in self.pods.items() if v["metadata"]["labels"].get("job-name") == name]:
                    del self.pods[pod]
            return web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Success",
                                      "details": {"name": name, "kind": kind, "uid": obj["metadata"]["uid"]}})

        @web.middleware
        async def record(request, handler):
            self.calls.append((request.method, request.path_qs))
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_post("/apis/batch/v1/namespaces/{ns}/jobs", create_job)
        app.router.add_get("/apis/batch/v1/namespaces/{ns}/{kind:jobs}", list_kind)
        app.router.add_get("/api/v1/namespaces/{ns}/{kind:pods}", list_kind)
        app.router.add_delete("/apis/batch/v1/namespaces/{ns}/{kind:jobs}/{name}", delete)
        app.router.add_delete("/api/v1/namespaces/{ns}/{kind:pods}/{name}", delete)
        return app


def _kubeconfig(port: int) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NS}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}]}


def _values(run_id: str, res: WorkerResources, port: int = 9) -> dict:
    return job_variables("k8s", res, run_id, image="zooid-worker:cuda-0.1.0",
                         extra={"namespace": NS, "cluster_config": {"config": _kubeconfig(port),
                                                                    "context_name": "fake"}})


def _configuration(run_id: str, res: WorkerResources):
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    return render(KubernetesWorkerJobConfiguration, template("kubernetes"), _values(run_id, res))


async def _serve(fake: FakeKubernetes, body):
    """Run `body(port)` against the fake API server on 127.0.0.1 (a free port)."""
    from aiohttp.test_utils import TestServer

    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        return await body(server.port)
    finally:
        await server.close()


def _launch_all(fake: FakeKubernetes, port: int, run_id: str, ranks: int, res: WorkerResources):
    """Create each worker's Job through the Kubernetes worker's own code and client."""
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    async def one(rank):
        cfg = await render_async(KubernetesWorkerJobConfiguration, template("kubernetes"),
                                 _values(run_id, res, port))
        fr = flow_run(f"{run_id}-e0-r{rank}-a0")
        cfg.prepare_for_flow_run(fr)
        worker = KubernetesWorker(work_pool_name="zooid-k8s")
        async with worker._get_configured_kubernetes_client(cfg) as client:
            job = await worker._create_job(cfg, client)
        return fr.model_copy(update={"infrastructure_pid": f"{job.metadata.namespace}:{job.metadata.name}"})

    return [one(r) for r in range(ranks)]


def test_gpu_pod_manifest_carries_nvidia_gpu_limit_and_run_label():
    cfg = _configuration("zrunk8sa", WorkerResources(vcpu=4, memory_gb=10, gpu=1, gpu_type="T4"))
    fr = flow_run("zrunk8sa-e0-r0-a0")
    cfg.prepare_for_flow_run(fr)
    pod = cfg.job_manifest["spec"]["template"]
    resources = pod["spec"]["containers"][0]["resources"]
    # 10 GB * 1.25 + 1 GB = 13.5 GB = 13824 Mi; requests equal limits.
    assert resources["limits"] == {"cpu": "4000m", "memory": "13824Mi", "nvidia.com/gpu": 1}
    assert resources["requests"] == {"cpu": "4000m", "memory": "13824Mi"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "Tesla-T4"}
    assert pod["metadata"]["labels"]["zooid-run"] == "zrunk8sa"
    assert pod["metadata"]["labels"]["prefect.io/flow-run-id"] == str(fr.id)


def test_cpu_pod_manifest_has_no_gpu_limit():
    cfg = _configuration("zrunk8sb", WorkerResources(vcpu=0.5, memory_gb=1))
    spec = cfg.job_manifest["spec"]["template"]["spec"]
    assert spec["containers"][0]["resources"]["limits"] == {"cpu": "500m", "memory": "2304Mi"}
    assert "nodeSelector" not in spec and "tolerations" not in spec


def test_create_cancel_and_sweep_through_the_client():
    from kubernetes_asyncio import config

    fake = FakeKubernetes()
    res = WorkerResources(vcpu=4, memory_gb=10, gpu=1, gpu_type="T4")

    async def body(port):
        launched = [await c for c in _launch_all(fake, port, "zrunk8sc", 3, res)]
        [other] = [await c for c in _launch_all(fake, port, "zrunother", 1, res)]
        created = next(j for j in fake.jobs.values() if j["metadata"]["labels"].get("zooid-run") == "zrunk8sc")
        limits = created["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1

        client = await config.new_client_from_config_dict(config_dict=_kubeconfig(port), context="fake")
        try:
            assert len(await cloud_k8s.list_run_pods(client, NS, "zrunk8sc")) == 3
            # Cancel: rank 0's Job is deleted straight from its flow run's infrastructure pid.
            deleted = await cloud_k8s.delete_flow_run_jobs(client, [launched[0]])
            assert deleted == [cloud_k8s.job_of_flow_run(launched[0])[1]]
            assert len(await cloud_k8s.list_run_pods(client, NS, "zrunk8sc")) == 2
            # Crash, then the sweep: nothing of the run is left, the other run is untouched.
            swept = await cloud_k8s.sweep(client, NS, "zrunk8sc")
            assert len(swept["jobs"]) == 2
            assert await cloud_k8s.list_run_pods(client, NS, "zrunk8sc") == []
            assert len(await cloud_k8s.list_run_pods(client, NS, "zrunother")) == 1
            assert await cloud_k8s.sweep(client, NS, "zrunk8sc") == {"jobs": [], "pods": []}
        finally:
            await client.close()
        return other

    asyncio.run(_serve(fake, body))
    assert ("POST", f"/apis/batch/v1/namespaces/{NS}/jobs") in fake.calls


def test_cost_from_pod_start_and_finish():
    from kubernetes_asyncio import config

    from coordinator.bill.cloud_bill import cloud_records
    from planners.catalog import get_offer

    ids = [str(uuid.uuid4()) for _ in range(3)]
    fake = FakeKubernetes()

    def labels(i):
        return {"zooid-run": "zrunk8sd", "prefect.io/flow-run-id": ids[i]}

    fake.pods = {
        "done": _pod("done", labels(0), "Succeeded", start="2026-11-20T10:00:02Z", started="2026-11-20T10:00:40Z",
                     finished="2026-11-20T10:10:02Z", exit_code=0),
        "stuck": _pod("stuck", labels(1), "Pending", start=None, unschedulable=True),
        "crashed": _pod("crashed", labels(2), "Failed", start="2026-11-20T10:00:02Z", started="2026-11-20T10:00:40Z",
                        finished="2026-11-20T10:01:02Z", exit_code=1),
    }

    async def body(port):
        client = await config.new_client_from_config_dict(config_dict=_kubeconfig(port), context="fake")
        try:
            return await cloud_k8s.run_intervals(client, NS, "zrunk8sd")
        finally:
            await client.close()

    intervals = sorted(asyncio.run(_serve(fake, body)), key=lambda i: ids.index(i.flow_run_id))
    assert [i.status for i in intervals] == ["completed", "failed_placement", "failed"]
    assert "Insufficient nvidia.com/gpu" in intervals[1].reason
    assert intervals[0].startup_s == pytest.approx(40.0)

    offer = get_offer("ec2-g4dn.xlarge")
    price = offer.price_per_s()
    rows = cloud_records("zrunk8sd", intervals, {ids[0]: (2, 0, 0), ids[1]: (2, 1, 0), ids[2]: (2, 1, 1)},
                         offer, price, now=1_790_000_000.0)
    done, stuck, crashed = rows
    assert (done.kind, done.seconds, done.usd) == ("worker", pytest.approx(600.0), pytest.approx(600 * 0.526 / 3600))
    assert (stuck.kind, stuck.usd) == ("failed_placement", 0.0)
    assert (crashed.kind, crashed.seconds) == ("failed_attempt", pytest.approx(60.0))

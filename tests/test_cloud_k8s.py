"""Kubernetes workers: our template renders through the real worker configuration with an
`nvidia.com/gpu` limit in the pod; create (the Kubernetes worker's own job creation, through its
own client from a cluster-config block), cancel, sweep and cost run through kubernetes_asyncio
against a fake API server on 127.0.0.1 that answers as the Kubernetes API documents it. The
answers are written for the tests, not recorded from a cluster: each is held to the kubernetes
client's models (`tests.provider_schemas.k8s`), and so is each Job the worker posts.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import re
import uuid

import pytest

from clouds import kubernetes as cloud_k8s
from clouds.provider import WorkerResources
from clouds.registry import job_variables
from tests.cloud_fixtures import flow_run, render, render_async, template
from tests.provider_schemas import SchemaError
from tests.provider_schemas import k8s as schemas

pytestmark = pytest.mark.timeout(60)
NS = "zooid"


def _pod(name: str, labels: dict, phase: str, *, start: str | None, started: str | None = None,
         finished: str | None = None, exit_code: int | None = None, unschedulable: bool = False) -> dict:
    """A pod as the API answers it (v1), trimmed of fields nothing reads."""
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


_MILLI = re.compile(r"^(\d+)m$")


def _canonical_quantity(value) -> str:
    """A quantity as the API server writes it back: a number as its string, whole milli-units as
    units ("4000m" -> "4"); the other forms Zooid's job variables write ("500m", "13824Mi") as sent."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(int(value)) if float(value).is_integer() else str(value)
    milli = _MILLI.match(value)
    return str(int(milli.group(1)) // 1000) if milli and int(milli.group(1)) % 1000 == 0 else value


def _stored(posted: dict) -> dict:
    """A posted Job as the API server stores and answers it: its containers' quantities canonical
    (a request may give a quantity as a number; an answer never does)."""
    job = copy.deepcopy(posted)
    for container in job["spec"]["template"]["spec"].get("containers", []):
        resources = container.get("resources", {})
        for part in ("limits", "requests"):
            if part in resources:
                resources[part] = {k: _canonical_quantity(v) for k, v in resources[part].items()}
    return job


class FakeKubernetes:
    """The Kubernetes API at the HTTP boundary: Jobs and pods in dicts, requests recorded; each
    answer held to the client's model for that call (a schema refusal answers 500, with the
    finding in the message, and is kept in `violations`)."""

    def __init__(self):
        self.jobs: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.violations: list[str] = []
        self.posted: list[dict] = []
        self._n = itertools.count()

    @staticmethod
    def _answer(model: str, body: dict, status: int = 200):
        """A JSON answer, held to the kubernetes client's `model` first."""
        from aiohttp import web

        return web.json_response(schemas.check(model, body), status=status)

    @staticmethod
    def _match(labels: dict, selector: str | None) -> bool:
        pairs = [p.split("=", 1) for p in (selector or "").split(",") if p]
        return all(labels.get(k) == v for k, v in pairs)

    def app(self):
        from aiohttp import web

        async def create_job(request):
            self.posted.append(await request.json())
            job = _stored(self.posted[-1])
            name = job["metadata"]["generateName"] + f"x{next(self._n)}"
            job["metadata"].update(name=name, uid=str(uuid.uuid4()), creationTimestamp="2026-11-20T10:00:00Z")
            self.jobs[name] = job
            pod_labels = {**job["spec"]["template"]["metadata"]["labels"], "job-name": name}
            self.pods[name + "-p"] = _pod(name + "-p", pod_labels, "Running", start="2026-11-20T10:00:02Z",
                                          started="2026-11-20T10:00:40Z")
            return self._answer("V1Job", job, 201)

        async def list_kind(request):
            kind = request.match_info["kind"]
            store = self.jobs if kind == "jobs" else self.pods
            items = [o for o in store.values()
                     if self._match(o["metadata"].get("labels", {}), request.query.get("labelSelector"))]
            return self._answer("V1JobList" if kind == "jobs" else "V1PodList",
                                {"apiVersion": "batch/v1" if kind == "jobs" else "v1",
                                 "kind": "JobList" if kind == "jobs" else "PodList",
                                 "metadata": {"resourceVersion": "1"}, "items": items})

        async def delete(request):
            kind, name = request.match_info["kind"], request.match_info["name"]
            store = self.jobs if kind == "jobs" else self.pods
            if name not in store:
                return self._answer("V1Status", {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                                 "reason": "NotFound", "code": 404,
                                                 "message": f'{kind} "{name}" not found'}, 404)
            obj = store.pop(name)
            if kind == "pods":  # a pod's DELETE answers the pod, marked for deletion (grace 0: gone at once)
                obj["metadata"].update(deletionTimestamp="2026-11-20T10:20:00Z", deletionGracePeriodSeconds=0)
                return self._answer("V1Pod", obj)
            # a Job's DELETE with background propagation answers a Status; its pods go after it
            for pod in [p for p, v in self.pods.items() if v["metadata"]["labels"].get("job-name") == name]:
                del self.pods[pod]
            return self._answer("V1Status", {"apiVersion": "v1", "kind": "Status", "status": "Success",
                                             "details": {"name": name, "group": "batch", "kind": kind,
                                                         "uid": obj["metadata"]["uid"]}})

        @web.middleware
        async def record(request, handler):
            self.calls.append((request.method, request.path_qs))
            try:
                return await handler(request)
            except SchemaError as exc:  # the client raises ApiException(500) with the finding in its body
                self.violations.append(str(exc))
                return web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                          "reason": "InternalError", "code": 500, "message": str(exc)}, status=500)

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


def test_rendered_job_is_a_v1_job_with_completions_on_the_job():
    """The template's Job as the API server would store it passes the client's V1Job strictly:
    `completions` and `parallelism` belong to the Job's spec (prefect-kubernetes' default template
    puts them in the pod's, where the API server drops them as unknown fields)."""
    cfg = _configuration("zrunk8se", WorkerResources(vcpu=4, memory_gb=10, gpu=1, gpu_type="T4"))
    cfg.prepare_for_flow_run(flow_run("zrunk8se-e0-r0-a0"))
    manifest = _stored(cfg.job_manifest)
    manifest["metadata"]["name"] = "zrunk8se-job"

    schemas.check("V1Job", manifest)
    assert (manifest["spec"]["completions"], manifest["spec"]["parallelism"]) == (1, 1)
    assert not {"completions", "parallelism"} & set(manifest["spec"]["template"]["spec"])


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
        posted = next(j for j in fake.posted if j["metadata"]["labels"].get("zooid-run") == "zrunk8sc")
        assert posted["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert (posted["spec"]["completions"], posted["spec"]["parallelism"]) == (1, 1)  # the Job's, not the pod's
        stored = next(j for j in fake.jobs.values() if j["metadata"]["labels"].get("zooid-run") == "zrunk8sc")
        assert stored["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
            "cpu": "4", "memory": "13824Mi", "nvidia.com/gpu": "1"}  # as the API server answers it

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


def test_sweep_deletes_a_live_pod_whose_job_is_gone():
    """A pod left running after its Job was deleted (orphan propagation, a Job removed by hand) is
    deleted by the sweep; the API answers a pod's DELETE with the pod itself (V1Pod, not a Status)."""
    from kubernetes_asyncio import config

    fake = FakeKubernetes()
    labels = {"zooid-run": "zrunk8sf", "job-name": "zrunk8sf-e0-r0-a0"}
    fake.pods = {"orphan": _pod("orphan", labels, "Running", start="2026-11-20T10:00:02Z",
                                started="2026-11-20T10:00:40Z"),
                 "finished": _pod("finished", labels, "Succeeded", start="2026-11-20T10:00:02Z",
                                  started="2026-11-20T10:00:40Z", finished="2026-11-20T10:05:00Z", exit_code=0)}

    async def body(port):
        client = await config.new_client_from_config_dict(config_dict=_kubeconfig(port), context="fake")
        try:
            return await cloud_k8s.sweep(client, NS, "zrunk8sf")
        finally:
            await client.close()

    assert asyncio.run(_serve(fake, body)) == {"jobs": [], "pods": ["orphan"]}
    assert list(fake.pods) == ["finished"] and fake.violations == []
    assert ("DELETE", f"/api/v1/namespaces/{NS}/pods/orphan?gracePeriodSeconds=0") in fake.calls

"""The cloud path end to end, per provider: `coordinator.workers.epoch_run.bill_from_cloud_clock` and
`coordinator.workers.cleanup.teardown_run` through the real adapter (`clouds.registry.adapter_for` on a
`ComputeTarget` of the provider's kind), with the cloud faked at its HTTP boundary: ECS through
botocore (wire JSON, parsed by botocore), ACI through the Azure SDK's transport
(`tests.test_cloud_aci.FakeArm`), Kubernetes through kubernetes_asyncio against a fake API server
(`tests.test_cloud_k8s.FakeKubernetes`), docker through docker-py against a fake engine
(`tests.fake_docker_engine.FakeEngine`, answering from podman's recorded `inspect` documents).
The ECS, ACI and Kubernetes answers are written for the tests, not recorded, and each is held to
the provider SDK's schema before the adapter sees it (`tests.provider_schemas`). Only the session
factory of each adapter is replaced, so the adapters' own listing, parsing, stopping and sweeping run.

One scenario for every provider, epoch 0 of a run with three ranks:

- `done`      rank 0 attempt 0, ran to completion;
- `never`     rank 1 attempt 0, never placed (no capacity / image pull failed);
- `cancelled` rank 1 attempt 1 (the relaunch), still running; its flow run is live, so the
              teardown cancels it and stops its infrastructure directly;
- `leaked`    rank 2 attempt 0, still running, though its flow run is already final (the
              coordinator crashed): only the sweep finds it.

Each provider is one row of `CLOUDS` (a `CloudCase`); docker's engine is
`tests.fake_docker_engine.FakeEngine`, a Docker API over HTTP answering from podman's recorded
`inspect` documents.
"""
from __future__ import annotations

import asyncio
import json
import threading
import uuid
from contextlib import asynccontextmanager
from datetime import datetime
from types import SimpleNamespace

import pytest

from blocks.compute import ComputeTarget
from clouds import aci as cloud_aci
from clouds import ecs as cloud_ecs
from clouds import kubernetes as cloud_k8s
from coordinator.bill import cloud_bill
from coordinator.bill.cost import coordinator_record, worker_records
from coordinator.run.context import RunContext
from coordinator.run.job import TrainJob
from coordinator.workers import cleanup as teardown_mod
from coordinator.workers import epoch_run as run_epoch_mod
from planners.catalog import get_offer
from tests.cloud_fixtures import _container, _task, describe_tasks_response, flow_run
from tests.provider_schemas.ecs import check_error, check_input, check_output

pytestmark = pytest.mark.timeout(60)

WORKERS = {"done": (0, 0), "never": (1, 0), "cancelled": (1, 1), "leaked": (2, 0)}
"""Worker -> (rank, attempt), all of epoch 0."""
MEMORY_GB = (2.0, 4.0, 1.0)
"""Each rank's size (per-stage sizes): every attempt is priced at its own rank's size."""
NOW = "now"
"""In an expected row: the clock of the bill that wrote it (a worker still running)."""
EPOCH_END = "epoch end"
"""In an expected row after teardown: the row the epoch-end bill wrote, unchanged."""


def iso(stamp: str) -> float:
    """Epoch seconds of an ISO-8601 UTC stamp as the Azure and Kubernetes answers write them."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class CloudCase:
    """One provider in the table. A subclass sets the class attributes and the methods that raise here."""

    kind: str
    """The ComputeTarget kind (`clouds.registry.adapter_for` picks the adapter by it)."""
    offer: str
    run_id: str
    job_variables: dict = {}
    epoch_end_now: float
    """The clock when the epoch-end bill runs."""
    teardown_now: float
    """The clock when the teardown's bill runs (after the cloud stopped `cancelled`)."""
    at_epoch_end: dict
    """Worker -> (kind, start, stop) billed at the epoch end (all four known to the cloud)."""
    after_teardown: dict
    """Worker -> (kind, start, stop) or EPOCH_END after a teardown that cancelled `cancelled`."""
    stopped: list
    """Workers whose infrastructure the teardown's `stop` step stops (the cancelled flow runs)."""
    swept: list
    """Workers whose infrastructure the sweep stops or deletes after `stop`."""
    swept_without_cancel: list
    """The same when cancelling failed (so `stop` had no flow run to stop)."""
    settled: list = []
    """Workers the `settle` step stops (still running once the others stopped), after `stop`."""
    settled_without_cancel: list = []
    """The same when cancelling failed."""
    after_teardown_without_cancel: dict | None = None
    """Worker -> row after a teardown whose cancel failed (None: as at the epoch end)."""

    def start(self, monkeypatch) -> None:
        """Load the recorded answers and point the adapter's session factory at them."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop whatever `start` started."""

    def resource(self, worker: str) -> str:
        """The name `stop` / `sweep` report for a worker's infrastructure."""
        raise NotImplementedError

    def infrastructure_pid(self, worker: str) -> str:
        """The flow run's `infrastructure_pid` as the pool's Prefect worker records it."""
        raise NotImplementedError

    def left_running(self) -> list[str]:
        """The run's resources the cloud still has running (or, where deletion is the sweep, still has)."""
        raise NotImplementedError

    def target(self) -> ComputeTarget:
        return ComputeTarget(kind=self.kind, work_pool=f"zooid-{self.kind}", offer=self.offer, worker_vcpu=1.0,
                             worker_memory_gb=2.0, job_variables=self.job_variables)

    def check_session(self, work_pool: str) -> None:
        assert work_pool == f"zooid-{self.kind}"  # the adapter reaches the target's pool

    def __repr__(self) -> str:
        return self.kind


# ----------------------------------------------------------------------------- ECS

ECS_T0 = 1_790_000_000.0  # `tests.cloud_fixtures.describe_tasks_response`'s clock


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **kwargs):
        yield self.data


def _wire(value):
    """A DescribeTasks task as ECS sends it (JSON: timestamps in epoch seconds)."""
    if isinstance(value, dict):
        return {k: _wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wire(v) for v in value]
    return value.timestamp() if isinstance(value, datetime) else value


class FakeEcs:
    """The ECS API at botocore's HTTP boundary (`before-send`): tasks as AWS describes them,
    ListTasks / DescribeTasks / StopTask answered from them, every call recorded. Each request
    and each answer is held to botocore's ECS model (`tests.provider_schemas.ecs`)."""

    def __init__(self, tasks: list[dict], stop_at: float):
        self.tasks = {t["taskArn"]: t for t in tasks}
        self.stop_at = stop_at
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, request, **kwargs):
        from botocore.awsrequest import AWSResponse

        target = request.headers["X-Amz-Target"]
        op = (target.decode() if isinstance(target, bytes) else target).rsplit(".", 1)[-1]
        body = check_input(op, json.loads(request.body or b"{}"))
        self.calls.append((op, body))
        status, reply = getattr(self, op)(body)
        if status == 200:
            check_output(op, reply, wire=True)
        else:
            check_error(op, reply)
        return AWSResponse(request.url, status, {"Content-Type": "application/x-amz-json-1.1",
                                                 "x-amzn-RequestId": str(uuid.uuid4())},
                           _Body(json.dumps(reply).encode()))

    def ListTasks(self, body):
        arns = [arn for arn, t in self.tasks.items()
                if t["startedBy"] == body.get("startedBy") and t["desiredStatus"] == body.get("desiredStatus", "RUNNING")]
        return 200, {"taskArns": arns}

    def DescribeTasks(self, body):
        assert body["include"] == ["TAGS"]
        return 200, {"tasks": [self.tasks[a] for a in body["tasks"] if a in self.tasks],
                     "failures": [{"arn": a, "reason": "MISSING"} for a in body["tasks"] if a not in self.tasks]}

    def StopTask(self, body):
        task = self.tasks.get(body["task"])
        if task is None:
            return 400, {"__type": "InvalidParameterException", "message": "The referenced task was not found."}
        if task["lastStatus"] != "STOPPED":
            task.update(desiredStatus="STOPPED", lastStatus="STOPPED", stoppingAt=self.stop_at,
                        executionStoppedAt=self.stop_at, stoppedAt=self.stop_at, stopCode="UserInitiated",
                        stoppedReason=body["reason"])
            for c in task["containers"]:
                c.update(lastStatus="STOPPED", exitCode=137)
        return 200, {"task": task}


class EcsCase(CloudCase):
    kind, offer, run_id = "ecs", "fargate-cpu", "zrun0001"  # the run id the recorded tasks carry
    job_variables = {"cluster": "zooid"}
    epoch_end_now, teardown_now = ECS_T0 + 700.0, ECS_T0 + 800.0
    # Fargate bills from the image pull to the stop; a task that never started costs nothing.
    at_epoch_end = {"done": ("worker", ECS_T0 + 6.5, ECS_T0 + 656.5),
                    "never": ("failed_placement", ECS_T0 + 1.0, ECS_T0 + 75.0),
                    "cancelled": ("worker", ECS_T0 + 8.0, NOW),
                    "leaked": ("worker", ECS_T0 + 9.0, NOW)}
    after_teardown = {**at_epoch_end, "cancelled": ("failed_attempt", ECS_T0 + 8.0, ECS_T0 + 760.0)}
    stopped, swept, swept_without_cancel = ["cancelled"], ["leaked"], ["cancelled", "leaked"]

    def start(self, monkeypatch):
        import boto3

        self.ids = {w: str(uuid.uuid4()) for w in WORKERS}
        recorded = _wire(describe_tasks_response((self.ids["done"], self.ids["never"], self.ids["cancelled"])))
        leaked_id = "3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b"
        leaked = _wire(_task(leaked_id, self.ids["leaked"], desiredStatus="RUNNING",
                             containers=[_container(leaked_id, "RUNNING")], lastStatus="RUNNING",
                             connectivity="CONNECTED", createdAt=ECS_T0 + 3.0, pullStartedAt=ECS_T0 + 9.0,
                             pullStoppedAt=ECS_T0 + 31.0, startedAt=ECS_T0 + 36.0))
        tasks = recorded["tasks"] + [leaked]
        self.arns = dict(zip(("done", "never", "cancelled", "leaked"), (t["taskArn"] for t in tasks)))
        self.fake = FakeEcs(tasks, stop_at=ECS_T0 + 760.0)
        client = boto3.client("ecs", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
        client.meta.events.register("before-send.ecs", self.fake)

        def session(work_pool, job_variables=None):
            self.check_session(work_pool)
            return client, job_variables["cluster"]

        monkeypatch.setattr(cloud_ecs, "ecs_session", session)

    def resource(self, worker):
        return self.arns[worker]

    def infrastructure_pid(self, worker):
        return f"zooid::{self.arns[worker]}"

    def left_running(self):
        return [a for a, t in self.fake.tasks.items() if t["startedBy"] == self.run_id and t["desiredStatus"] == "RUNNING"]


# ----------------------------------------------------------------------------- ACI

class AciCase(CloudCase):
    kind, offer, run_id = "aci", "aci-cpu", "zpathsaci001"
    epoch_end_now, teardown_now = iso("2026-11-20T10:02:40Z"), iso("2026-11-20T10:04:00Z")
    # ACI bills from the first image pull (10:00:05) to termination; `FakeArm` stops a group at
    # 10:03:00 (exit 137). A group that never pulled has no time of its own: listed at the bill's clock.
    at_epoch_end = {"done": ("worker", iso("2026-11-20T10:00:05Z"), iso("2026-11-20T10:02:30Z")),
                    "never": ("failed_placement", NOW, NOW),
                    "cancelled": ("worker", iso("2026-11-20T10:00:05Z"), NOW),
                    "leaked": ("worker", iso("2026-11-20T10:00:05Z"), NOW)}
    after_teardown = {**at_epoch_end,
                      "cancelled": ("failed_attempt", iso("2026-11-20T10:00:05Z"), iso("2026-11-20T10:03:00Z"))}
    # the sweep deletes every group of the run (stopped ones too), once the bill has read them
    stopped, swept = ["cancelled"], ["done", "never", "cancelled", "leaked"]
    swept_without_cancel = swept

    def start(self, monkeypatch):
        from tests.test_cloud_aci import RG, FakeArm, _clients, _group

        self.ids = {w: str(uuid.uuid4()) for w in WORKERS}
        self.names = {w: f"worker-{i}" for w, i in self.ids.items()}
        n = self.names
        self.arm = FakeArm()
        self.arm.groups = {
            n["done"]: _group(n["done"], self.run_id, "Terminated", started="2026-11-20T10:01:50Z",
                              finished="2026-11-20T10:02:30Z", exit_code=0, gpu=False),
            n["never"]: _group(n["never"], self.run_id, "Waiting", started=None, pulled=False,
                               provisioning="Failed", gpu=False),
            n["cancelled"]: _group(n["cancelled"], self.run_id, "Running", started="2026-11-20T10:01:50Z", gpu=False),
            n["leaked"]: _group(n["leaked"], self.run_id, "Running", started="2026-11-20T10:01:55Z", gpu=False),
            "worker-other": _group("worker-other", "zotherrun", "Running", started="2026-11-20T10:01:50Z", gpu=False),
        }
        aci, _ = _clients(self.arm)

        def session(work_pool, job_variables=None):
            self.check_session(work_pool)
            return aci, RG

        monkeypatch.setattr(cloud_aci, "aci_session", session)

    def resource(self, worker):
        return self.names[worker]

    def infrastructure_pid(self, worker):
        return f"{self.ids[worker]}:{self.names[worker]}"

    def left_running(self):
        return sorted(name for name, g in self.arm.groups.items() if g["tags"].get("zooid-run") == self.run_id)


# ----------------------------------------------------------------------------- Kubernetes

class _ServedApp:
    """An aiohttp app on 127.0.0.1 served from its own thread and loop (the adapter runs its
    coroutines on Prefect's run-sync loop, another thread)."""

    def __init__(self, app):
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def up():
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            return runner, runner.addresses[0][1]

        self.runner, self.port = asyncio.run_coroutine_threadsafe(up(), self.loop).result(30)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


class K8sCase(CloudCase):
    kind, offer, run_id = "k8s", "ec2-g4dn.xlarge", "zpathsk8s001"
    epoch_end_now, teardown_now = iso("2026-11-20T10:12:00Z"), iso("2026-11-20T10:14:00Z")
    # A pod is billed from its startTime (the pull counts) to its container's finish; an
    # unschedulable pod is listed at its creation, free.
    at_epoch_end = {"done": ("worker", iso("2026-11-20T10:00:02Z"), iso("2026-11-20T10:10:02Z")),
                    "never": ("failed_placement", iso("2026-11-20T10:00:00Z"), iso("2026-11-20T10:00:00Z")),
                    "cancelled": ("worker", iso("2026-11-20T10:00:02Z"), NOW),
                    "leaked": ("worker", iso("2026-11-20T10:00:03Z"), NOW)}
    # `stop` deletes the cancelled worker's Job, and the fake API server drops its pod at once:
    # the cluster no longer reports it, so its row stays as the epoch-end bill wrote it.
    after_teardown = {**at_epoch_end, "cancelled": EPOCH_END}
    # the sweep deletes every Job the run still has (the cancelled one is gone already)
    stopped, swept = ["cancelled"], ["done", "never", "leaked"]
    swept_without_cancel = ["done", "never", "cancelled", "leaked"]

    def start(self, monkeypatch):
        from kubernetes_asyncio import config

        from tests.test_cloud_k8s import NS, FakeKubernetes, _kubeconfig, _pod

        self.ids = {w: str(uuid.uuid4()) for w in WORKERS}
        self.jobs = {w: f"{self.run_id}-e0-r{r}-a{a}" for w, (r, a) in WORKERS.items()}
        self.fake = FakeKubernetes()

        def labels(worker, run_id=self.run_id):
            return {"zooid-run": run_id, "prefect.io/flow-run-id": self.ids[worker], "job-name": self.jobs[worker]}

        pods = {
            "done": _pod("done-p", labels("done"), "Succeeded", start="2026-11-20T10:00:02Z",
                         started="2026-11-20T10:00:40Z", finished="2026-11-20T10:10:02Z", exit_code=0),
            "never": _pod("never-p", labels("never"), "Pending", start=None, unschedulable=True),
            "cancelled": _pod("cancelled-p", labels("cancelled"), "Running", start="2026-11-20T10:00:02Z",
                              started="2026-11-20T10:00:40Z"),
            "leaked": _pod("leaked-p", labels("leaked"), "Running", start="2026-11-20T10:00:03Z",
                           started="2026-11-20T10:00:41Z"),
        }
        for worker, pod in pods.items():
            name = self.jobs[worker]
            self.fake.pods[pod["metadata"]["name"]] = pod
            self.fake.jobs[name] = {
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4()),
                             "labels": {"zooid-run": self.run_id}, "creationTimestamp": "2026-11-20T10:00:00Z"},
                "spec": {"template": {"metadata": {"labels": labels(worker)},
                                      "spec": {"containers": [{"name": "prefect-job", "image": "zooid-worker"}]}}}}
        other = _pod("other-p", {"zooid-run": "zotherrun", "job-name": "zotherrun-e0-r0-a0"}, "Running",
                     start="2026-11-20T10:00:02Z", started="2026-11-20T10:00:40Z")
        self.fake.pods["other-p"] = other
        self.server = _ServedApp(self.fake.app())
        port = self.server.port

        @asynccontextmanager
        async def session(work_pool, job_variables=None):
            self.check_session(work_pool)
            client = await config.new_client_from_config_dict(config_dict=_kubeconfig(port), context="fake")
            try:
                yield client, NS
            finally:
                await client.close()

        monkeypatch.setattr(cloud_k8s, "k8s_session", session)

    def close(self):
        self.server.close()

    def resource(self, worker):
        return self.jobs[worker]

    def infrastructure_pid(self, worker):
        return f"zooid:{self.jobs[worker]}"

    def left_running(self):
        jobs = [n for n, j in self.fake.jobs.items() if j["metadata"]["labels"].get("zooid-run") == self.run_id]
        pods = [n for n, p in self.fake.pods.items() if p["metadata"]["labels"].get("zooid-run") == self.run_id]
        return sorted(jobs + pods)


# ----------------------------------------------------------------------------- docker

DOCKER_T0 = 1_790_000_000.0


class DockerCase(CloudCase):
    kind, offer, run_id = "docker", "fargate-cpu", "zpathsdocker1"
    epoch_end_now, teardown_now = DOCKER_T0 + 700.0, DOCKER_T0 + 800.0
    # the engine's clock: StartedAt to FinishedAt; a container that never started costs nothing.
    # The fake engine stops a container at +760 s (exit 143).
    at_epoch_end = {"done": ("worker", DOCKER_T0 + 2.0, DOCKER_T0 + 600.0),
                    "never": ("failed_placement", DOCKER_T0 + 1.5, DOCKER_T0 + 1.5),
                    "cancelled": ("worker", DOCKER_T0 + 3.0, NOW),
                    "leaked": ("worker", DOCKER_T0 + 4.0, NOW)}
    # before the last bill the teardown stops what still runs (settle), so each container has a FinishedAt
    after_teardown = {**at_epoch_end, "cancelled": ("failed_attempt", DOCKER_T0 + 3.0, DOCKER_T0 + 760.0),
                      "leaked": ("failed_attempt", DOCKER_T0 + 4.0, DOCKER_T0 + 760.0)}
    after_teardown_without_cancel = after_teardown
    stopped, settled, settled_without_cancel = ["cancelled"], ["leaked"], ["cancelled", "leaked"]
    # the sweep removes every container of the run, once the bill has read them
    swept = ["done", "never", "cancelled", "leaked"]
    swept_without_cancel = swept

    def start(self, monkeypatch):
        from clouds import docker as cloud_docker
        from tests.fake_docker_engine import FakeEngine, container, stamp

        self.ids = {w: str(uuid.uuid4()) for w in WORKERS}
        self.cids = {w: uuid.uuid4().hex + uuid.uuid4().hex for w in WORKERS}

        def labels(worker, run_id=self.run_id):
            return {"zooid-run": run_id, "io.prefect.flow-run-id": self.ids[worker]}

        t = lambda s: stamp(DOCKER_T0 + s)  # noqa: E731
        docs = {
            "done": container("completed", self.cids["done"], labels("done"),
                              StartedAt=t(2.0), FinishedAt=t(600.0), ExitCode=0),
            "never": container("never_started", self.cids["never"], labels("never")),
            "cancelled": container("running", self.cids["cancelled"], labels("cancelled"), StartedAt=t(3.0)),
            "leaked": container("running", self.cids["leaked"], labels("leaked"), StartedAt=t(4.0)),
        }
        docs["done"]["Created"], docs["never"]["Created"] = t(1.0), t(1.5)
        docs["cancelled"]["Created"], docs["leaked"]["Created"] = t(2.5), t(3.5)
        other = container("running", "f" * 64, {"zooid-run": "zotherrun"}, StartedAt=t(3.0))
        self.engine = FakeEngine({d["Id"]: d for d in [*docs.values(), other]}, stop_at=DOCKER_T0 + 760.0)
        monkeypatch.setattr(cloud_docker, "docker_client", lambda *a, **k: self.engine.client())
        monkeypatch.setattr(cloud_docker, "SETTLE_S", 0.0)  # nothing exits by itself here: stop at once
        # what the adapter saw of a run lives as long as the process: each case's engine starts afresh
        monkeypatch.setattr(cloud_docker.DockerAdapter, "seen", {})

    def close(self):
        self.engine.close()

    def resource(self, worker):
        return self.cids[worker][:12]

    def infrastructure_pid(self, worker):
        return f"{self.engine.url}:{self.cids[worker]}"

    def left_running(self):
        return sorted(cid[:12] for cid, doc in self.engine.containers.items()
                      if doc["Config"]["Labels"].get("zooid-run") == self.run_id)


CLOUDS = [EcsCase, AciCase, K8sCase, DockerCase]
"""The table: one row per cloud adapter."""


# ----------------------------------------------------------------------------- the run

class Clock:
    """`coordinator.bill.cloud_bill`'s clock (a worker still running is billed up to it), set per bill."""

    def __init__(self):
        self.now = 0.0

    def time(self) -> float:
        return self.now


@pytest.fixture(params=CLOUDS, ids=lambda c: c.kind)
def cloud(request, monkeypatch):
    case = request.param()
    case.start(monkeypatch)
    yield case
    case.close()


@pytest.fixture
def clock(monkeypatch):
    clk = Clock()
    monkeypatch.setattr(cloud_bill, "time", clk)
    return clk


def _plan():
    """The run's plan as far as billing reads it: a size per rank (per-stage sizes)."""
    return SimpleNamespace(stage_memory_gb=MEMORY_GB, memory_gb_of=lambda rank: MEMORY_GB[rank])


def _context(cloud: CloudCase) -> RunContext:
    """The run as the coordinator holds it after epoch 0: its own launch-to-exit estimate of
    every attempt and its own row in the ledger."""
    target, offer = cloud.target(), get_offer(cloud.offer)
    ctx = RunContext(run_id=cloud.run_id, job=TrainJob(workers=3),
                     resolved=SimpleNamespace(target=target, offer=offer))
    measured = [dict(rank=r, attempt=a, status="completed" if w == "done" else "failed",
                     started_at=100.0 + i, stopped_at=200.0 + i) for i, (w, (r, a)) in enumerate(WORKERS.items())]
    ctx.state.ledger.extend(worker_records(cloud.run_id, 0, measured, offer, ctx.price_of(_plan())))
    ctx.state.ledger.append(coordinator_record(cloud.run_id, 50.0, 900.0, offer, ctx.price_per_worker_s))
    return ctx


def _price(cloud: CloudCase, rank: int) -> float:
    t = cloud.target()
    return get_offer(cloud.offer).price_per_s(t.worker_vcpu, MEMORY_GB[rank], t.worker_gpu)


def _bill_epoch_end(cloud: CloudCase, ctx: RunContext, clock: Clock) -> None:
    """What `run_epoch` does when an epoch's workers are done: the cloud's clock replaces
    the coordinator's estimate of each of the epoch's attempts."""
    outcomes = [SimpleNamespace(ref=cloud.ids[w], rank=r, attempt=a) for w, (r, a) in WORKERS.items()]
    clock.now = cloud.epoch_end_now
    run_epoch_mod.bill_from_cloud_clock(ctx, outcomes, 0, _plan())


def _worker_rows(ctx: RunContext) -> dict:
    """The ledger's worker rows by worker name (the coordinator's row apart): one per attempt.
    A failed placement is listed again, at $0, by every later bill (the latest copy is
    returned; `test_a_failed_placement_is_listed_once_however_often_the_run_is_billed`)."""
    by_attempt = {ra: w for w, ra in WORKERS.items()}
    keyed: dict[str, list] = {}
    for r in ctx.state.ledger:
        if r.kind != "coordinator":
            keyed.setdefault(by_attempt[(r.rank, r.attempt)], []).append(r)
    assert sorted(keyed) == sorted(WORKERS)
    for worker, rows in keyed.items():
        assert len(rows) == 1 or all(r.kind == "failed_placement" and r.usd == 0.0 for r in rows), (worker, rows)
    return {worker: rows[-1] for worker, rows in keyed.items()}


def _assert_billed(cloud: CloudCase, rows: dict, expected: dict, now: float, epoch_end_rows: dict | None = None):
    for worker, want in expected.items():
        row = rows[worker]
        if want == EPOCH_END:
            assert row == epoch_end_rows[worker], worker
            continue
        kind, start, stop = (now if v == NOW else v for v in want)
        rank = WORKERS[worker][0]
        assert (row.kind, row.start, row.stop, row.epoch) == (kind, start, stop, 0), worker
        if kind == "failed_placement":  # listed, never billed
            assert (row.unit_price_per_s, row.usd, row.worker) == (0.0, 0.0, ""), worker
        else:  # the cloud's seconds at the price of the size that rank was launched with
            assert row.unit_price_per_s == _price(cloud, rank), worker
            assert row.usd == pytest.approx((stop - start) * _price(cloud, rank), rel=1e-12), worker
            assert row.worker == cloud.ids[worker]


def _cancelled_flow_runs(cloud: CloudCase, monkeypatch, fail: Exception | None = None) -> None:
    """The Prefect API's answer to the teardown's cancel: the `cancelled` worker's flow run
    (the `leaked` one is final already), or `fail`."""
    run = flow_run(f"{cloud.run_id}-e0-r1-a1", cloud.infrastructure_pid("cancelled"))
    run = run.model_copy(update={"id": uuid.UUID(cloud.ids["cancelled"])})

    def cancel(run_id):
        assert run_id == cloud.run_id
        if fail is not None:
            raise fail
        return [run]

    monkeypatch.setattr(teardown_mod, "cancel_flow_runs", cancel)


# ----------------------------------------------------------------------------- the tests

def test_the_bill_of_an_epoch_is_on_the_clouds_clock(cloud, clock):
    ctx = _context(cloud)
    coordinator = [r for r in ctx.state.ledger if r.kind == "coordinator"]

    _bill_epoch_end(cloud, ctx, clock)

    # every attempt the cloud reported replaced the coordinator's launch-to-exit estimate
    _assert_billed(cloud, _worker_rows(ctx), cloud.at_epoch_end, cloud.epoch_end_now)
    assert [r for r in ctx.state.ledger if r.kind == "coordinator"] == coordinator
    # each attempt at the price of its size and capacity, beside the capacity and its on-demand price
    assert ctx.state.cloud_attempts == {cloud.ids[w]: (0, r, a, _price(cloud, r), "on_demand", _price(cloud, r))
                                        for w, (r, a) in WORKERS.items()}
    assert cloud.left_running()  # billing stops nothing


def test_teardown_stops_bills_then_sweeps(cloud, clock, monkeypatch, capsys):
    ctx = _context(cloud)
    _bill_epoch_end(cloud, ctx, clock)
    epoch_end_rows = _worker_rows(ctx)
    _cancelled_flow_runs(cloud, monkeypatch)
    clock.now = cloud.teardown_now

    report = teardown_mod.teardown_run(ctx)

    assert report["errors"] == {} and "cancel_error" not in report
    assert report["cancelled_flow_runs"] == 1
    assert report["stopped"] == [cloud.resource(w) for w in cloud.stopped + cloud.settled]
    assert sorted(report["swept"]) == sorted(cloud.resource(w) for w in cloud.swept)
    assert cloud.left_running() == []
    _assert_billed(cloud, _worker_rows(ctx), cloud.after_teardown, cloud.teardown_now, epoch_end_rows)
    assert "teardown" not in capsys.readouterr().out
    assert ctx.state.torn_down


def test_a_billing_error_still_sweeps_and_is_reported(cloud, clock, monkeypatch, capsys):
    ctx = _context(cloud)
    _bill_epoch_end(cloud, ctx, clock)
    ledger = list(ctx.state.ledger)
    _cancelled_flow_runs(cloud, monkeypatch)
    clock.now = cloud.teardown_now

    def broken(*args, **kwargs):
        raise RuntimeError("price catalog unreadable")

    monkeypatch.setattr(run_epoch_mod, "cloud_records", broken)
    report = teardown_mod.teardown_run(ctx)

    assert report["errors"] == {"bill": "RuntimeError: price catalog unreadable"}
    assert "zooid: teardown bill failed: RuntimeError: price catalog unreadable\n" in capsys.readouterr().out
    assert report["stopped"] == [cloud.resource(w) for w in cloud.stopped + cloud.settled]
    assert sorted(report["swept"]) == sorted(cloud.resource(w) for w in cloud.swept)
    assert cloud.left_running() == []
    assert ctx.state.ledger == ledger  # the epoch-end bill stands


def test_a_cancel_error_still_bills_and_sweeps(cloud, clock, monkeypatch, capsys):
    """The Prefect API is gone: no flow run to cancel or stop, so the sweep stops everything,
    after the bill has read every worker still running up to the teardown's clock."""
    ctx = _context(cloud)
    _bill_epoch_end(cloud, ctx, clock)
    _cancelled_flow_runs(cloud, monkeypatch, fail=ConnectionError("API unreachable"))
    clock.now = cloud.teardown_now

    report = teardown_mod.teardown_run(ctx)

    assert report["errors"] == {"cancel": "ConnectionError: API unreachable"}
    assert report["cancel_error"] == "ConnectionError: API unreachable"
    assert "zooid: teardown cancel failed: ConnectionError: API unreachable\n" in capsys.readouterr().out
    assert report["cancelled_flow_runs"] == 0
    assert report["stopped"] == [cloud.resource(w) for w in cloud.settled_without_cancel]
    assert sorted(report["swept"]) == sorted(cloud.resource(w) for w in cloud.swept_without_cancel)
    assert cloud.left_running() == []
    _assert_billed(cloud, _worker_rows(ctx), cloud.after_teardown_without_cancel or cloud.at_epoch_end,
                   cloud.teardown_now)


def test_a_failed_placement_is_listed_once_however_often_the_run_is_billed(cloud, clock):
    ctx = _context(cloud)
    _bill_epoch_end(cloud, ctx, clock)
    clock.now = cloud.teardown_now
    run_epoch_mod.bill_from_cloud_clock(ctx, [], 1, _plan())  # the next epoch's bill re-reads epoch 0's attempts

    assert [(r.epoch, r.rank, r.attempt) for r in ctx.state.ledger if r.kind == "failed_placement"] == [(0, 1, 0)]

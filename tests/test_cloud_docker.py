"""The docker target's adapter on the engine's recorded answers (tests/data/docker/, recorded from
podman's Docker API by record.py there), its job variables, template and registration."""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from clouds.docker import (
    FLOW_RUN_LABEL,
    RUN_LABEL,
    DockerAdapter,
    container_interval,
    container_of_flow_run,
    run_intervals,
    stop_containers,
    sweep,
)
from clouds.provider import WorkerResources
from clouds.registry import job_variables
from clouds.timestamps import epoch_seconds

DATA = Path(__file__).resolve().parent / "data" / "docker"


def answer(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


class FakeContainer:
    """A container as docker-py shows it, from a recorded `inspect` answer; records calls."""

    def __init__(self, attrs: dict, calls: list):
        self.attrs, self.calls = attrs, calls
        self.id = attrs["Id"]
        self.status = attrs["State"]["Status"]
        self.labels = attrs["Config"]["Labels"]

    def stop(self, timeout=None):
        self.calls.append(("stop", self.id[:12]))

    def remove(self, force=False):
        self.calls.append(("remove", self.id[:12]))


class FakeContainers:
    def __init__(self, containers: list[FakeContainer]):
        self.containers = containers
        self.filters = []

    def list(self, all=False, filters=None, sparse=False):
        self.filters.append((all, filters))
        label = (filters or {}).get("label", "")
        key, _, value = label.partition("=")
        return [c for c in self.containers if c.attrs["Config"]["Labels"].get(key) == value]

    def get(self, cid):
        from docker.errors import NotFound

        for c in self.containers:
            if c.id.startswith(cid):
                return c
        raise NotFound(f"no container {cid}")


class FakeClient:
    def __init__(self, names: list[str]):
        self.calls: list = []
        self.containers = FakeContainers([FakeContainer(answer(n), self.calls) for n in names])
        self.closed = False

    def close(self):
        self.closed = True


ALL = ["completed", "failed", "killed", "running", "created", "never_started"]


def test_engine_timestamps_parse_with_nanoseconds_and_zero_means_never():
    assert epoch_seconds("2026-11-25T13:54:01.00740713Z") == pytest.approx(
        epoch_seconds("2026-11-25T13:54:01Z") + 0.007407, abs=1e-6)
    assert epoch_seconds("2026-11-25T13:54:01.5+01:00") == pytest.approx(epoch_seconds("2026-11-25T12:54:01.5Z"))
    assert epoch_seconds("0001-01-01T00:00:00Z") is None and epoch_seconds(None) is None


def test_one_timestamp_reading_for_every_provider():
    """clouds.timestamps.epoch_seconds: the SDKs' datetimes (ECS, ACI, Kubernetes), numbers and
    the engine's RFC 3339 text all read as epoch seconds; nothing and "never" read as None."""
    utc = datetime(2026, 11, 25, 13, 54, 1, 7407, tzinfo=timezone.utc)
    assert epoch_seconds(utc) == utc.timestamp()
    plus_one = datetime(2026, 11, 25, 14, 54, 1, 7407, tzinfo=timezone(timedelta(hours=1)))
    assert epoch_seconds(plus_one) == utc.timestamp()
    naive = datetime(2026, 11, 25, 13, 54, 1)
    assert epoch_seconds(naive) == naive.timestamp()  # local time, as datetime.timestamp reads it
    assert epoch_seconds(1764078841) == 1764078841.0 and isinstance(epoch_seconds(1764078841), float)
    assert epoch_seconds(1764078841.25) == 1764078841.25 and epoch_seconds("1764078841.25") == 1764078841.25
    assert epoch_seconds("2026-11-25T13:54:01.007407Z") == pytest.approx(utc.timestamp())
    assert epoch_seconds("2026-11-25T13:54:01.007407123Z") == pytest.approx(utc.timestamp())  # nanoseconds cut
    assert epoch_seconds("2026-11-25T13:54:01.0074Z") == pytest.approx(utc.timestamp() - 0.000007, abs=1e-9)
    assert epoch_seconds("2026-11-25T13:54:01+00:00") == epoch_seconds("2026-11-25T13:54:01Z") == int(utc.timestamp())
    assert epoch_seconds(" 2026-11-25T13:54:01Z ") == int(utc.timestamp())
    for nothing in (None, "", "  ", "0001-01-01T00:00:00Z", "0001-01-01T00:00:00.000000000Z", object()):
        assert epoch_seconds(nothing) is None, nothing
    with pytest.raises(ValueError):
        epoch_seconds("yesterday")


def test_each_recorded_container_state_is_billed_on_the_engines_clock():
    by = {name: container_interval(answer(name)) for name in ALL}
    done = by["completed"]
    state = answer("completed")["State"]
    assert done.status == "completed" and done.billed_from == epoch_seconds(state["StartedAt"])
    assert done.stopped == epoch_seconds(state["FinishedAt"]) and done.created == epoch_seconds(answer("completed")["Created"])
    assert done.flow_run_id == answer("completed")["Config"]["Labels"][FLOW_RUN_LABEL]
    assert done.resource == answer("completed")["Id"][:12]
    killed = by["killed"]
    assert killed.status == "failed" and killed.reason == "exit code 137"
    assert killed.stopped - killed.billed_from > 1.0  # it slept until killed
    # podman stamps a short container's FinishedAt before its StartedAt: an empty interval, never negative
    failed = answer("failed")["State"]
    assert epoch_seconds(failed["FinishedAt"]) < epoch_seconds(failed["StartedAt"])
    assert by["failed"].status == "failed" and by["failed"].stopped == by["failed"].billed_from
    assert by["running"].status == "running" and by["running"].stopped is None
    for name in ("created", "never_started"):  # never ran: listed, never billed
        assert by[name].status == "failed_placement" and by[name].billed_from is None


def test_cloud_records_price_each_container_from_start_to_finish():
    from coordinator.bill.cloud_bill import cloud_records
    from planners.catalog import get_offer

    intervals = [container_interval(answer(n)) for n in ("completed", "killed", "never_started")]
    attempts = {intervals[0].flow_run_id: (0, 0, 0, 2.0), intervals[1].flow_run_id: (0, 1, 0, 2.0)}
    rows = cloud_records("rec-run", intervals, attempts, get_offer("fargate-cpu"), price_per_s=1.0)
    by_kind = {r.kind: r for r in rows}
    assert by_kind["worker"].start == intervals[0].billed_from and by_kind["worker"].stop == intervals[0].stopped
    assert by_kind["worker"].usd == pytest.approx((intervals[0].stopped - intervals[0].billed_from) * 2.0)
    assert by_kind["failed_attempt"].usd == pytest.approx((intervals[1].stopped - intervals[1].billed_from) * 2.0)
    assert by_kind["failed_placement"].usd == 0.0


def test_a_warm_worker_told_to_stop_is_billed_as_completed_even_when_its_container_was_stopped():
    """The teardown tells each warm worker to stop, then stops the containers that have not
    exited in time (exit 137): their work was done, so they are no failed attempts; a container
    killed while it worked still is."""
    from coordinator.bill.cloud_bill import cloud_records
    from planners.catalog import get_offer

    killed = container_interval(answer("killed"))
    other = dataclasses.replace(killed, flow_run_id="another-flow-run", resource="0123456789ab")
    attempts = {killed.flow_run_id: (None, 0, None, 2.0), other.flow_run_id: (None, 1, None, 2.0)}
    rows = cloud_records("rec-run", [killed, other], attempts, get_offer("fargate-cpu"), price_per_s=1.0,
                         asked_to_stop={killed.flow_run_id})
    by_rank = {r.rank: r for r in rows}
    assert (by_rank[0].kind, by_rank[0].status) == ("worker", "completed")
    assert (by_rank[1].kind, by_rank[1].status) == ("failed_attempt", "failed")
    assert by_rank[0].usd == pytest.approx((killed.stopped - killed.billed_from) * 2.0)


def test_intervals_stop_and_sweep_through_the_adapter(monkeypatch):
    client = FakeClient(ALL)
    monkeypatch.setattr("clouds.docker.docker_client", lambda *a, **k: client)
    adapter = DockerAdapter("zooid-docker")
    got = adapter.intervals("rec-run")
    assert len(got) == len(ALL) and client.containers.filters[-1] == (True, {"label": f"{RUN_LABEL}=rec-run"})
    assert adapter.intervals("another-run") == []

    running = answer("running")["Id"]

    class FlowRun:
        infrastructure_pid = f"unix:///run/podman.sock:{running}"

    assert container_of_flow_run(FlowRun) == running
    assert adapter.stop([FlowRun]) == [running[:12]]
    assert client.calls == [("stop", running[:12])]
    client.calls.clear()
    swept = adapter.sweep("rec-run")
    assert sorted(swept) == sorted(answer(n)["Id"][:12] for n in ALL)
    stopped = {cid for op, cid in client.calls if op == "stop"}
    removed = {cid for op, cid in client.calls if op == "remove"}
    assert stopped == {answer(n)["Id"][:12] for n in ("running", "created", "never_started")}
    assert removed == set(swept) and client.closed


@pytest.mark.timeout(120)
def test_settling_waits_only_for_a_container_the_pool_started(monkeypatch):
    """A container without Prefect's flow-run label (a straggler the pool did not start) has no
    flow run to finish: settling stops it at once, however long it would wait otherwise (a
    wait would end only at the test's timeout); one the pool started is waited for, then
    stopped."""
    straggler = answer("running")
    straggler.update(Id="5" * 64)
    del straggler["Config"]["Labels"][FLOW_RUN_LABEL]
    client = FakeClient([])
    client.containers.containers.append(FakeContainer(straggler, client.calls))
    monkeypatch.setattr("clouds.docker.docker_client", lambda *a, **k: client)
    assert DockerAdapter("zooid-docker").settle("rec-run", timeout_s=3600) == ["5" * 12]
    assert client.calls == [("stop", "5" * 12)]

    client = FakeClient(["running"])  # labelled: waited for until it exits by itself (the third look)
    monkeypatch.setattr("clouds.docker.docker_client", lambda *a, **k: client)
    looks, real_list = [], client.containers.list

    def look(**kw):
        looks.append(1)
        if len(looks) == 3:
            client.containers.containers[0].status = "exited"
        return real_list(**kw)

    client.containers.list = look
    assert DockerAdapter("zooid-docker").settle("rec-run", timeout_s=3600, poll_s=0) == []
    assert client.calls == [] and len(looks) == 3


def test_stopping_a_container_that_is_gone_is_not_an_error():
    client = FakeClient(["completed"])
    assert stop_containers(client, ["deadbeef0000"]) == []
    assert run_intervals(client, "rec-run")[0].status == "completed"
    assert sweep(client, "other") == []


def test_docker_job_variables_size_the_container_and_label_the_run():
    res = WorkerResources(vcpu=1.5, memory_gb=1.0)
    out = job_variables("docker", res, "run-1", image="localhost/zooid-worker:cpu", env={"A": "1"},
                        extra={"env": {"PREFECT_HOME": "/tmp/prefect"}, "container_create_kwargs": {"shm_size": "1g"}})
    mib = 1.0 * 1.25 * 1024 + 1024
    assert out["mem_limit"] == f"{int(mib)}m" and out["memswap_limit"] == out["mem_limit"]
    assert out["container_create_kwargs"] == {"shm_size": "1g", "nano_cpus": 1_500_000_000, "init": True}
    assert out["labels"] == {"zooid-run": "run-1", "zooid.capacity": "on_demand"} and out["zooid_run_id"] == "run-1"
    assert out["env"] == {"PREFECT_HOME": "/tmp/prefect", "A": "1"} and out["image"] == "localhost/zooid-worker:cpu"
    gpu = job_variables("docker", WorkerResources(vcpu=4, memory_gb=8, gpu=1, gpu_type="T4"), "r")
    assert gpu["container_create_kwargs"]["device_requests"] == [{"driver": "nvidia", "count": 1,
                                                                  "capabilities": [["gpu"]]}]
    # docker-py takes the request as written
    from docker.types import DeviceRequest

    assert DeviceRequest(**gpu["container_create_kwargs"]["device_requests"][0])["Count"] == 1


def test_the_docker_template_extends_prefect_dockers_default():
    from prefect_docker.worker import DockerWorker

    from tests.cloud_fixtures import template

    default = DockerWorker.get_default_base_job_template()
    ours = template("docker")
    assert set(default["variables"]["properties"]) <= set(ours["variables"]["properties"])
    assert set(default["job_configuration"]) <= set(ours["job_configuration"])
    props = ours["variables"]["properties"]
    assert props["image_pull_policy"]["default"] == "Never"  # the image is built on the engine
    assert props["auto_remove"]["default"] is False  # the clock is read after exit; the sweep removes
    assert props["stream_output"]["default"] is True  # follow the log, not podman's polling wait
    for name, prop in props.items():
        assert prop.get("title") and prop.get("description"), name


def test_the_docker_target_is_registered_once_and_refuses_a_local_directory_store(tmp_path):
    from blocks.compute import resolve_target
    from clouds.registry import adapter_for, is_cloud
    from coordinator.run.job import TrainJob
    from coordinator.run.validate import validate_job
    from core.errors import ZooidValueError

    target = resolve_target("docker")
    assert target.kind == "docker" and is_cloud(target) and isinstance(adapter_for(target), DockerAdapter)
    assert target.work_pool == "zooid-docker" and target.worker_deployment == "worker/docker"
    with pytest.raises(ZooidValueError, match=r"^store: file://.*cannot reach.*S3 or Redis"):
        validate_job(TrainJob(target="docker", store=f"file://{tmp_path}"), check_store=False)
    with pytest.raises(ZooidValueError, match=r"^durable_store: "):
        validate_job(TrainJob(target="docker", store="redis://127.0.0.1:1/0"), check_store=False)


def test_ended_tells_a_dead_container_under_a_running_flow_run(monkeypatch):
    """A container killed outright leaves its flow run Running: `ended` is what the launcher asks."""
    from tests.fake_docker_engine import FakeEngine

    docs = {answer(n)["Id"]: answer(n) for n in ("running", "killed")}
    engine = FakeEngine(docs, stop_at=0.0)
    try:
        monkeypatch.setattr("clouds.docker.docker_client", lambda *a, **k: engine.client())
        adapter = DockerAdapter("zooid-docker")
        assert adapter.ended(f"{engine.url}:{answer('running')['Id']}") is None
        killed = adapter.ended(f"{engine.url}:{answer('killed')['Id']}")
        assert killed == {"exit_code": 137, "reason": f"container {answer('killed')['Id'][:12]} failed: exit code 137"}
        gone = adapter.ended(f"{engine.url}:{'0' * 64}")
        assert gone == {"exit_code": None, "reason": f"container {'0' * 12} is gone"}
        assert adapter.ended("not-a-pid") is None
    finally:
        engine.close()

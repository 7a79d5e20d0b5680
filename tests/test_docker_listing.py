"""A container removed while the run's containers are being listed, on a real podman engine.

docker-py's full listing inspects every container it listed; one removed in between makes podman
answer `500 ... no such container` (an `APIError`, not `NotFound`), which used to fail the whole
listing, and with it the bill, the sweep and the liveness check. Here the race is real and made
deterministic: the client's inspect removes the container (`podman rm -f` through the API) just
before it inspects it. The engine is a podman API service of the test's own (`deployments.engine`,
its own socket), over the machine's images.
"""
from __future__ import annotations

import shutil
import uuid

import pytest

from clouds.adapter import RUN_LABEL
from clouds.docker import DockerAdapter, SeenContainers, docker_client, run_containers, run_intervals, sweep

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(client, an image on the engine, DOCKER_HOST) of a podman API service started for this module."""
    if not shutil.which("podman"):
        pytest.skip("no podman (make test installs it)")
    from deployments import engine as podman_engine

    home = tmp_path_factory.mktemp("engine")
    state = podman_engine.up(home)
    client = docker_client(state["docker_host"])
    try:
        tags = [t for image in client.images.list() for t in image.tags]
        image = next((t for t in tags if "zooid-worker" in t), tags[0] if tags else None)
        if image is None:
            pytest.skip("no image on the engine (make image builds the worker image)")
        yield client, image, state["docker_host"]
    finally:
        client.close()
        podman_engine.down(home)


@pytest.fixture
def run(engine):
    """A run id with two sleeping containers labelled with it; every container of it removed after."""
    client, image, _ = engine
    run_id = f"zlist{uuid.uuid4().hex[:8]}"
    containers = [client.containers.run(image, ["sleep", "600"], detach=True, labels={RUN_LABEL: run_id},
                                        stop_signal="SIGKILL") for _ in range(2)]
    try:
        yield run_id, containers
    finally:
        for c in client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"}, sparse=True):
            client.api.remove_container(c.id, force=True)


def removed_while_inspected(client, victim_id: str) -> list[str]:
    """Make the client's inspect of `victim_id` remove it first (a real removal, then the real
    inspect: the engine's own answer); returns the ids removed so."""
    real, removed = client.api.inspect_container, []

    def inspect(container):
        if container.startswith(victim_id[:12]) and not removed:
            client.api.remove_container(victim_id, force=True)
            removed.append(victim_id)
        return real(container)

    client.api.inspect_container = inspect
    return removed


def test_the_engine_answers_an_inspect_of_a_removed_container_as_the_issue_says(engine, run):
    """What docker-py's own full listing meets: podman's answer to the inspect after the removal."""
    from docker.errors import APIError

    client, _, _ = engine
    run_id, (victim, _) = run
    removed = removed_while_inspected(client, victim.id)
    try:
        with pytest.raises(APIError) as refused:
            client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})
        assert removed == [victim.id] and "no such container" in str(refused.value).lower()
    finally:
        del client.api.inspect_container


def test_listing_billing_and_the_sweep_survive_a_container_removed_mid_listing(engine, run):
    client, _, _ = engine
    run_id, (victim, survivor) = run
    seen = SeenContainers()
    before = run_intervals(client, run_id, seen)  # both running, both seen
    assert {i.resource for i in before} == {victim.id[:12], survivor.id[:12]}
    assert {i.status for i in before} == {"running"}

    removed = removed_while_inspected(client, victim.id)
    try:
        listed = run_containers(client, run_id)
        assert removed == [victim.id] and [c.id for c in listed] == [survivor.id]
        after = {i.resource: i for i in run_intervals(client, run_id, seen, now=1e10)}
    finally:
        del client.api.inspect_container
    # the survivor from the engine; the vanished one from what was last seen, billed to when it was
    # first seen gone (here `now`), once
    assert after[survivor.id[:12]].status == "running"
    gone = after[victim.id[:12]]
    last = next(i for i in before if i.resource == victim.id[:12])
    assert (gone.status, gone.billed_from, gone.stopped) == ("failed", last.billed_from, 1e10)
    assert len(after) == 2
    # a later look keeps the first time it was seen gone
    assert {i.resource: i.stopped for i in run_intervals(client, run_id, seen, now=2e10)}[victim.id[:12]] == 1e10

    # the sweep meets a container removed under it too
    removed = removed_while_inspected(client, survivor.id)
    try:
        assert sweep(client, run_id, grace_s=0) == []
    finally:
        del client.api.inspect_container
    assert removed == [survivor.id] and run_containers(client, run_id) == []


def test_the_adapter_bills_and_checks_liveness_across_a_removal(engine, run, monkeypatch):
    """The adapter (one per call, as the bill makes them) keeps what it saw per run id; `ended`
    says a removed container is gone (podman's 500 or a 404 alike)."""
    client, _, host = engine
    run_id, (victim, survivor) = run
    monkeypatch.setenv("DOCKER_HOST", host)
    monkeypatch.setattr(DockerAdapter, "seen", {})
    assert len(DockerAdapter("zooid-docker").intervals(run_id)) == 2
    assert DockerAdapter("zooid-docker").ended(f"{host}:{survivor.id}") is None  # running
    client.api.remove_container(victim.id, force=True)
    bill = {i.resource: i for i in DockerAdapter("zooid-docker").intervals(run_id)}
    assert set(bill) == {victim.id[:12], survivor.id[:12]} and bill[victim.id[:12]].status == "failed"
    assert bill[victim.id[:12]].stopped >= bill[victim.id[:12]].billed_from
    assert DockerAdapter("zooid-docker").ended(f"{host}:{victim.id}") == {
        "exit_code": None, "reason": f"container {victim.id[:12]} is gone"}

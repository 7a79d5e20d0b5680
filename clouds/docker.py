"""Docker-API containers (podman's socket here, Docker elsewhere): workers' cost on the engine's
clock, the sweep that removes stragglers, and the container of a flow run.

The `docker` target runs each worker as a container of a Prefect Docker work pool
(prefect-docker's worker). Every container carries the label `zooid-run=<run_id>` (the
`labels` job variable) and Prefect's flow-run label, which prefect-docker writes in Docker's
reverse-DNS form, `io.prefect.flow-run-id`. The flow run's `infrastructure_pid` is
`<engine base URL>:<container id>`.

A container is billed from `State.StartedAt` to `State.FinishedAt` (the engine's own clock;
there is no pull to bill, the image is local). `FinishedAt` can read a few milliseconds before
`StartedAt` for a very short container: the interval is then empty, never negative. A
container that never started (created only, or a start that failed: a bad command, no such
user) is a failed placement: listed, not billed. Containers are kept after they exit (`auto_remove` off in the
pool's template) so their clock can be read after the epoch; the sweep removes them.
A container can vanish at any moment (a preemption, a sweep): the listing inspects each one
itself and leaves out one gone in between (`run_containers`), and the adapter bills one gone
since the last look from what it last saw (`SeenContainers`).

The functions take a `docker.DockerClient`, so they run the same against a real engine or
recorded API answers; `docker_client()` opens one at `DOCKER_HOST` (what the pool's worker
uses too).

The provider (`Docker`): a container gets a memory limit without extra swap and a CPU quota
(`nano_cpus`), and, for GPUs, a device request; `deployments.docker_stack` starts the engine
and the pool's worker it needs, and its adapter's `preflight` checks the engine and the image.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar, Iterable

from clouds.adapter import RUN_LABEL, CloudAdapter, CloudInterval
from clouds.provider import FLOW_RUN_COMMAND, Provider, WorkerResources, run_labels
from clouds.timestamps import epoch_seconds
from core.errors import ZooidValueError
from core.kinds import Capacity, TargetKind

FLOW_RUN_LABEL = "io.prefect.flow-run-id"
"""Prefect's `prefect.io/flow-run-id` as prefect-docker labels a container."""
CAPACITY_LABEL = "zooid.capacity"
"""The label that says a container's capacity (`on_demand` or `spot`): a preemptor stops spot ones."""
RUNNING = ("running", "paused", "restarting")
"""Engine states of a container that has started and not exited."""
SETTLE_S = 15.0
"""How long the teardown waits for the run's containers to exit by themselves before stopping them."""
API_VERSION = "1.41"
"""The Docker Engine API version a client speaks (Docker 20.10+, podman 3+). Named, because a
client left to find it asks the engine's `/version` first, and podman answers that by querying
the host's package manager: about 0.2 s of CPU on every client opened."""


def container_interval(attrs: dict) -> CloudInterval:
    """One container's `inspect` answer as a `CloudInterval`."""
    state = attrs.get("State") or {}
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    created = epoch_seconds(attrs.get("Created"))
    started = epoch_seconds(state.get("StartedAt"))
    finished = epoch_seconds(state.get("FinishedAt"))
    status_word = state.get("Status", "")
    if status_word in RUNNING + ("stopping",):
        status, stopped = "running", None
    elif started is None:  # created and never started (a start that failed leaves it so): costs nothing
        status, stopped = "failed_placement", finished or created
    else:
        status = "completed" if state.get("ExitCode") == 0 and not state.get("OOMKilled") else "failed"
        stopped = max(started, finished if finished is not None else started)
    reason = state.get("Error") or ("out of memory" if state.get("OOMKilled") else "")
    if not reason and status == "failed":
        reason = f"exit code {state.get('ExitCode')}"
    elif not reason and status == "failed_placement":
        reason = "created, never started"
    return CloudInterval(resource=attrs.get("Id", "")[:12], flow_run_id=labels.get(FLOW_RUN_LABEL),
                         billed_from=started, stopped=stopped, status=status, created=created,
                         started=started, reason=reason)


def gone(exc: Exception) -> bool:
    """Whether an engine error says the container no longer exists: docker's `NotFound`, or
    podman's `500 ... no such container` (an `APIError`) for one removed a moment before."""
    from docker.errors import APIError, NotFound

    return isinstance(exc, NotFound) or (isinstance(exc, APIError) and "no such container" in str(exc).lower())


def run_containers(client, run_id: str) -> list:
    """The run's containers, running or exited (label `zooid-run=<run_id>`), each inspected.

    Listed sparse (the list's own answer, no inspect), then inspected one by one: a container
    removed between the two (a preemption, a sweep) is left out instead of failing the whole
    listing, as docker-py's full listing does (podman answers its inspect `500 no such container`)."""
    from docker.errors import APIError

    found = []
    for listed in client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"}, sparse=True):
        try:
            found.append(client.containers.get(listed.id))
        except APIError as exc:
            if not gone(exc):
                raise
    return found


@dataclass
class SeenContainers:
    """What the engine last said of a run's containers: each one's last `inspect` answer and,
    once it is gone, when it was first seen gone (epoch seconds), so that one removed while
    running is still billed (`run_intervals`)."""

    attrs: dict = field(default_factory=dict)
    gone_at: dict = field(default_factory=dict)


def run_intervals(client, run_id: str, seen: SeenContainers | None = None,
                  now: float | None = None) -> list[CloudInterval]:
    """Every container of the run on the engine's clock: the ones the engine still lists and,
    with `seen` (what earlier calls saw, updated here), the ones gone since, billed from their
    last-seen answer; one gone while running stops when it was first seen gone (`now`)."""
    containers = run_containers(client, run_id)
    intervals = [container_interval(c.attrs) for c in containers]
    if seen is None:
        return intervals
    present = {c.attrs.get("Id", c.id) for c in containers}
    seen.attrs.update({c.attrs.get("Id", c.id): c.attrs for c in containers})
    for cid, attrs in seen.attrs.items():
        if cid in present:
            continue
        at = seen.gone_at.setdefault(cid, time.time() if now is None else now)
        interval = container_interval(attrs)
        if interval.status == "running":  # removed under us: billed to when it was first seen gone
            interval = dataclasses.replace(interval, status="failed", stopped=max(at, interval.billed_from or at),
                                           reason="removed while running (billed to when first seen gone)")
        intervals.append(interval)
    return intervals


def stop_containers(client, ids: Iterable[str], grace_s: int = 5) -> list[str]:
    """Stop each container (SIGTERM, then SIGKILL after `grace_s`), all at once: a process that
    ignores SIGTERM (a container's PID 1 without a handler does) costs the grace once, not once
    per container. One already gone is skipped."""
    from docker.errors import APIError

    def stop(cid: str) -> bool:
        try:
            return _stop(client.containers.get(cid), grace_s)
        except APIError as exc:
            if not gone(exc):
                raise
            return False

    ids = list(ids)
    return [cid[:12] for cid, stopped in zip(ids, _at_once(stop, ids)) if stopped]


def _stop(container, grace_s: int) -> bool:
    """SIGTERM, then SIGKILL after `grace_s`; False when the container is gone."""
    from docker.errors import APIError

    try:
        container.stop(timeout=grace_s)
    except APIError as exc:  # gone, or already exited: nothing to stop
        if gone(exc):
            return False
        if "not running" not in str(exc).lower():
            raise
    return True


def preempt(client, container_id: str, grace_s: float) -> dict:
    """A spot provider taking a worker's container back, as the engine's `stop -t GRACE` does it:
    SIGTERM to its PID 1, SIGKILL `grace_s` seconds later if it still runs. Returns what happened:
    `container`, `grace_s`, `exit_code` and `killed` (it outlived the grace: exit 137), or
    `gone` when the container had ended meanwhile. For tests and benchmarks (`ZOOID_CHAOS`'s
    `preempt_worker` is the same from inside a worker)."""
    from docker.errors import APIError

    try:
        container = client.containers.get(container_id)
        stopped = _stop(container, max(0, math.ceil(grace_s)))
        container.reload()
    except APIError as exc:
        if not gone(exc):
            raise
        return {"container": container_id[:12], "grace_s": grace_s, "gone": True}
    code = (container.attrs.get("State") or {}).get("ExitCode")
    return {"container": container_id[:12], "grace_s": grace_s, "gone": not stopped, "exit_code": code,
            "killed": code == 137}


def _at_once(fn, items: list) -> list:
    """`fn` over `items` in threads of their own (engine calls that mostly wait), results in order."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(16, len(items))) as pool:
        return list(pool.map(fn, items))


def container_id(infrastructure_pid: str | None) -> str | None:
    """The container id in a flow run's `infrastructure_pid` `<engine base URL>:<id>`."""
    pid = infrastructure_pid or ""
    if ":" not in pid:
        return None
    return pid.rsplit(":", 1)[1] or None


def container_of_flow_run(flow_run) -> str | None:
    """The container id of a worker flow run."""
    return container_id(getattr(flow_run, "infrastructure_pid", None))


def sweep(client, run_id: str, grace_s: int = 5) -> list[str]:
    """Stop every container of the run still running (all at once, `stop_containers`) and
    remove all of them (their clock has been read by then: `tasks.teardown` bills first).
    Returns the containers swept."""
    from docker.errors import APIError

    containers = run_containers(client, run_id)
    _at_once(lambda c: _stop(c, grace_s), [c for c in containers if c.status in RUNNING + ("created",)])
    swept = []
    for container in containers:
        try:
            container.remove(force=True)
        except APIError as exc:
            if not gone(exc):
                raise
            continue
        swept.append(container.id[:12])
    return swept


def docker_client(base_url: str | None = None, timeout_s: int = 30):
    """A client of the engine at `base_url`, else `DOCKER_HOST` (as the pool's worker connects),
    speaking `API_VERSION`."""
    import docker

    url = base_url or os.environ.get("DOCKER_HOST")
    if url:
        return docker.DockerClient(base_url=url, timeout=timeout_s, version=API_VERSION)
    return docker.from_env(timeout=timeout_s, version=API_VERSION)


class DockerAdapter(CloudAdapter):
    """A Docker-API engine behind the adapter interface: the one at `DOCKER_HOST`, where the
    pool's worker starts the containers."""

    def _with_client(self, fn):
        client = docker_client()
        try:
            return fn(client)
        finally:
            client.close()

    seen: ClassVar[dict[str, SeenContainers]] = {}
    """Run id -> what this process last saw of its containers (adapters are made per call), so a
    container removed between two bills is still billed from its last-seen answer."""

    def intervals(self, run_id: str) -> list[CloudInterval]:
        seen = self.seen.setdefault(run_id, SeenContainers())
        return self._with_client(lambda c: run_intervals(c, run_id, seen))

    def stop(self, flow_runs: Iterable) -> list[str]:
        ids = [cid for cid in map(container_of_flow_run, flow_runs) if cid]
        return self._with_client(lambda c: stop_containers(c, ids)) if ids else []

    def sweep(self, run_id: str) -> list[str]:
        return self._with_client(lambda c: sweep(c, run_id))

    def ended(self, infrastructure_pid: str) -> dict | None:
        """The container's exit when it is no longer running (killed, out of memory, gone)."""
        from docker.errors import APIError

        cid = container_id(infrastructure_pid)
        if cid is None:
            return None
        client = docker_client(timeout_s=10)
        try:
            try:
                attrs = client.containers.get(cid).attrs
            except APIError as exc:
                if not gone(exc):
                    raise
                return {"exit_code": None, "reason": f"container {cid[:12]} is gone"}
        finally:
            client.close()
        interval = container_interval(attrs)
        if interval.status == "running":
            return None
        return {"exit_code": (attrs.get("State") or {}).get("ExitCode"),
                "reason": f"container {cid[:12]} {interval.status}: {interval.reason}".rstrip(": ")}

    def settle(self, run_id: str, timeout_s: float | None = None, poll_s: float = 0.2) -> list[str]:
        """Wait for the run's containers to exit (a warm worker told to stop exits a moment
        after its flow run completes), then stop the ones still running: each then has a
        `FinishedAt` for the bill. Only a container the pool started (Prefect's flow-run
        label) has a flow run to finish: one without it is not waited for."""
        def running(client):
            return [c for c in run_containers(client, run_id) if c.status in RUNNING]

        client = docker_client()
        try:
            deadline = time.monotonic() + (SETTLE_S if timeout_s is None else timeout_s)
            left = running(client)
            while any(c.labels.get(FLOW_RUN_LABEL) for c in left) and time.monotonic() < deadline:
                time.sleep(poll_s)
                left = running(client)
            return stop_containers(client, [c.id for c in left]) if left else []
        finally:
            client.close()

    def preflight(self, image: str | None) -> None:
        """The engine answers and holds `image` (the pool pulls nothing: `Never`)."""
        url = os.environ.get("DOCKER_HOST") or "the default socket"
        try:
            client = docker_client(timeout_s=10)
            client.ping()
        except Exception as exc:
            raise ZooidValueError("target", f"no container engine answers at DOCKER_HOST={url} "
                                  f"({type(exc).__name__}); start one with `python -m deployments.engine up`") from None
        try:
            if not image:
                raise ZooidValueError("image", "the docker target has no worker image: set the target's `image` "
                                      "or bootstrap its pool with `--image` (`make image` builds one)")
            from docker.errors import ImageNotFound

            try:
                client.images.get(image)
            except ImageNotFound:
                raise ZooidValueError("image", f"{image!r} is not on the engine at {url}; `make image` builds "
                                      "the worker image (the pool never pulls)") from None
        finally:
            client.close()


def docker_job_variables(res: WorkerResources, run_id: str) -> dict:
    """A Docker-API container: `mem_limit` (MiB, no swap beyond it) and a CPU quota in
    `nano_cpus`; GPUs through a device request (Docker's `--gpus`); the engine as its command
    (`FLOW_RUN_COMMAND`) under the engine's init process (`init`: docker's tini, podman's
    catatonit), which passes the stop's SIGTERM on: the kernel never delivers a signal left at its
    default to a namespace's PID 1, so before the flow's own handler is in place (the engine's
    start-up: imports, the API's flow run) the notice would be ignored until the SIGKILL."""
    memory = f"{math.ceil(res.requested_memory_gb * 1024 - 1e-9)}m"
    create = {"nano_cpus": math.ceil(res.vcpu * 1e9 - 1e-9), "init": True}
    if res.gpu:
        create["device_requests"] = [{"driver": "nvidia", "count": res.gpu, "capabilities": [["gpu"]]}]
    return {"mem_limit": memory, "memswap_limit": memory, "container_create_kwargs": create,
            "zooid_run_id": run_id, "labels": run_labels(run_id), "command": FLOW_RUN_COMMAND}


class Docker(Provider):
    """The `docker` target: containers on a Docker-API engine started by prefect-docker's worker."""

    kind = TargetKind.DOCKER
    title = "Docker"
    adapter = DockerAdapter

    @classmethod
    def setup_command(cls) -> str:
        return "`python -m deployments.stack up --docker`"

    @classmethod
    def size(cls, res: WorkerResources, run_id: str) -> dict:
        return docker_job_variables(res, run_id)

    @classmethod
    def on_capacity(cls, sized: dict, capacity: str) -> dict:
        """Either capacity: the container carries it as the label `zooid.capacity` (the engine has
        no spot market: a spot container is one a preemptor may stop, priced as Fargate Spot)."""
        if capacity not in (Capacity.ON_DEMAND, Capacity.SPOT):
            return super().on_capacity(sized, capacity)
        return {**sized, "labels": {**sized["labels"], CAPACITY_LABEL: str(capacity)}}

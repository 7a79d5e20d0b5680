"""ACI workers: their cost on Azure's clock, the sweep that removes stragglers, and the container
group of a flow run.

Every worker's container group carries the tag `zooid-run=<run_id>` (the ARM template in
`deployments/templates/azure-container-instance.json` sets it from `zooid_run_id`), and its
name ends with the worker flow run's id (`<flow>-<flow_run_id>`, as the ACI worker names it).
Zooid's job variables keep the group after the container exits (`keep_container_group`),
so its events survive for the bill; the sweep deletes the run's groups once the cost is read.

ACI bills a container group from the start of its first image pull to the container's
termination. A group whose container never started (no capacity for the GPU SKU in the
region, an image that cannot be pulled) is a failed placement: listed, not billed.

The functions take a `ContainerInstanceManagementClient`; `aci_session` builds one from the
work pool, with the credentials block the pool names.

The provider (`Aci`): workers carry cpu, memory (0.1 GB steps) and, for GPUs, `{"count", "sku"}`
(one of `ACI_GPU_SKUS`) in the ARM template. Its cloud bootstrap needs a resource group and a
subscription, makes an `AzureContainerInstanceCredentials` block from AZURE_* variables, and
may create the Azure Blob container its workers' store lives in.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

from clouds.adapter import RUN_LABEL, CloudAdapter, CloudInterval, pool_job_configuration
from clouds.provider import FLOW_RUN_COMMAND, JobVariablesError, Provider, WorkerResources, run_labels
from clouds.timestamps import epoch_seconds
from core.kinds import Capacity, TargetKind

ACI_GPU_SKUS = ("K80", "P100", "V100")
"""The GPU SKUs a container group may ask for."""
_UUID_SUFFIX = re.compile(r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$")


def flow_run_id_of(group_name: str) -> str | None:
    """The worker flow run id at the end of a container group's name."""
    m = _UUID_SUFFIX.search(group_name or "")
    return m.group(1) if m else None


def aci_interval(group) -> CloudInterval:
    """One container group (read with `get`, so it carries its instance view) as a `CloudInterval`."""
    container = group.containers[0]
    view = container.instance_view
    events = list(view.events or []) if view is not None else []
    pulls = [epoch_seconds(e.first_timestamp) for e in events if e.name == "Pulling" and e.first_timestamp]
    current = view.current_state if view is not None else None
    started = epoch_seconds(current.start_time) if current is not None else None
    finished = epoch_seconds(current.finish_time) if current is not None else None
    state = current.state if current is not None else None
    ever_started = started is not None or any(e.name == "Started" for e in events)
    if ever_started:
        status = ("completed" if current.exit_code == 0 else "failed") if state == "Terminated" else "running"
    else:  # still pulling or waiting for capacity, or it never will
        failed = group.provisioning_state == "Failed" or state == "Terminated"
        status = "failed_placement" if failed else "running"
    stopped = finished if status in ("completed", "failed", "failed_placement") else None
    created = min(pulls) if pulls else started
    reason = (current.detail_status or "") if current is not None else ""
    return CloudInterval(resource=group.name, flow_run_id=flow_run_id_of(group.name),
                         billed_from=min(pulls) if pulls else started, stopped=stopped, status=status,
                         created=created, started=started, reason=reason)


def list_run_groups(aci, resource_group: str, run_id: str) -> list[str]:
    """Names of the run's container groups (tag `zooid-run`) in `resource_group`."""
    return [g.name for g in aci.container_groups.list_by_resource_group(resource_group)
            if (g.tags or {}).get(RUN_LABEL) == run_id]


def run_intervals(aci, resource_group: str, run_id: str) -> list[CloudInterval]:
    """Every container group of the run, on Azure's clock (each read with its instance view)."""
    return [aci_interval(aci.container_groups.get(resource_group, name))
            for name in list_run_groups(aci, resource_group, run_id)]


def delete_groups(aci, resource_group: str, names: Iterable[str], wait: bool = True) -> list[str]:
    """Delete container groups (which stops their billing); a group already gone is skipped."""
    from azure.core.exceptions import ResourceNotFoundError

    deleted, pollers = [], []
    for name in names:
        try:
            pollers.append(aci.container_groups.begin_delete(resource_group, name))
        except ResourceNotFoundError:
            continue
        deleted.append(name)
    if wait:
        for poller in pollers:
            poller.result()
    return deleted


def sweep(aci, resource_group: str, run_id: str) -> list[str]:
    """Delete every container group of the run, running or stopped. Read the cost first."""
    return delete_groups(aci, resource_group, list_run_groups(aci, resource_group, run_id))


def group_of_flow_run(flow_run) -> str | None:
    """The container group of a worker flow run, from its `infrastructure_pid` `<flow_run_id>:<group>`."""
    pid = getattr(flow_run, "infrastructure_pid", None) or ""
    _, sep, group = pid.partition(":")
    return group if sep and group else None


def stop_flow_run_groups(aci, resource_group: str, flow_runs: Iterable) -> list[str]:
    """Stop the container group behind each flow run directly (billing stops; events are kept
    for the bill until the sweep deletes the group)."""
    from azure.core.exceptions import ResourceNotFoundError

    stopped = []
    for fr in flow_runs:
        name = group_of_flow_run(fr)
        if name is None:
            continue
        try:
            aci.container_groups.stop(resource_group, name)
        except ResourceNotFoundError:
            continue
        stopped.append(name)
    return stopped


def aci_session(work_pool: str, job_variables: dict | None = None):
    """(ContainerInstanceManagementClient, resource group) as the pool's workers see them."""
    from prefect_azure.workers.container_instance import AzureContainerJobConfiguration

    cfg = pool_job_configuration(AzureContainerJobConfiguration, work_pool, job_variables)
    client = cfg.aci_credentials.get_container_client(cfg.subscription_id.get_secret_value())
    return client, cfg.resource_group_name


class AciAdapter(CloudAdapter):
    """Azure Container Instances behind the adapter interface. Read the intervals before the
    sweep: the sweep deletes the groups, and their events with them."""

    def _session(self):
        return aci_session(self.work_pool, self.job_variables)

    def intervals(self, run_id: str) -> list[CloudInterval]:
        aci, group = self._session()
        return run_intervals(aci, group, run_id)

    def stop(self, flow_runs: Iterable) -> list[str]:
        aci, group = self._session()
        return stop_flow_run_groups(aci, group, flow_runs)

    def sweep(self, run_id: str) -> list[str]:
        aci, group = self._session()
        return sweep(aci, group, run_id)


def aci_job_variables(res: WorkerResources, run_id: str) -> dict:
    """ACI: cpu and memory (0.1 GB steps) and, for GPU workers, `{"count", "sku"}`; the flow run's
    engine as the container's command (`FLOW_RUN_COMMAND`), with no entrypoint script before it
    (the template's default, Prefect images' `/opt/prefect/entrypoint.sh`, is not in Zooid's worker
    image; the engine is then the process the eviction's SIGTERM reaches)."""
    # Keep the group after the container exits: its events are the bill (the sweep deletes it).
    out = {"cpu": math.ceil(res.vcpu * 10 - 1e-9) / 10, "memory": math.ceil(res.requested_memory_gb * 10 - 1e-9) / 10,
           "keep_container_group": True, "zooid_run_id": run_id, "labels": run_labels(run_id),
           "command": FLOW_RUN_COMMAND, "entrypoint": None}  # no Prefect image's entrypoint.sh before it
    if res.gpu:
        sku = (res.gpu_type or "").upper()
        if sku not in ACI_GPU_SKUS:
            raise JobVariablesError("gpu_type", f"ACI offers {', '.join(ACI_GPU_SKUS)}, got {res.gpu_type!r}")
        out["gpu"] = {"count": res.gpu, "sku": sku}
    return out


class Aci(Provider):
    """The `aci` target: container groups started by prefect-azure's ACI worker."""

    kind = TargetKind.ACI
    title = "ACI"
    adapter = AciAdapter
    account_options = {"resource_group": "resource_group_name", "subscription_id": "subscription_id"}
    account_required = ("resource_group", "subscription_id")
    credentials_variable = "aci_credentials"
    blob_store = True
    store_suggestion = ("an Azure Blob store (a zooid-azure-blob-store block on az://<container>/<prefix>; "
                        "`python -m deployments.bootstrap --target aci --blob-container <name>` creates both)")

    @classmethod
    def size(cls, res: WorkerResources, run_id: str) -> dict:
        return aci_job_variables(res, run_id)

    @classmethod
    def on_capacity(cls, sized: dict, capacity: str) -> dict:
        """Spot: the container group's `priority: Spot` (CPU only: ACI refuses a Spot group that
        asks for GPUs, JobVariablesError naming `capacity`); on-demand: as sized."""
        if capacity != Capacity.SPOT:
            return super().on_capacity(sized, capacity)
        if sized.get("gpu"):
            raise JobVariablesError("capacity", "ACI Spot container groups take no GPU; use on_demand for GPU workers")
        return {**sized, "priority": "Spot"}

    @classmethod
    def credentials_block(cls, environ: Mapping[str, str]) -> tuple[str, Any] | None:
        """`zooid-azure`, an `AzureContainerInstanceCredentials` from AZURE_CLIENT_ID and its companions."""
        if not environ.get("AZURE_CLIENT_ID"):
            return None
        from prefect_azure import AzureContainerInstanceCredentials

        return "zooid-azure", AzureContainerInstanceCredentials(
            client_id=environ["AZURE_CLIENT_ID"], tenant_id=environ.get("AZURE_TENANT_ID"),
            client_secret=environ.get("AZURE_CLIENT_SECRET"))

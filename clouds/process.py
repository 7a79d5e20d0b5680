"""The built-in process pool (the `local` target): workers are Prefect flow runs started as
processes on this machine by the pool's process worker (in the local stack, forked from
`flows.flow_forks`, which the pool's `command` points at).

Nothing runs on a provider's clock: no adapter, no worker size in the job variables (a worker
takes the threads the launcher gives it), no cloud account; the process sweep
(`coordinator.workers.sweep`) stops its stragglers. Its pool uses the process worker's own base
job template (`deployments.bootstrap` ships none for it).
"""
from __future__ import annotations

from clouds.provider import Provider
from core.kinds import TargetKind


class ProcessPool(Provider):
    """The `local` target: Prefect's process work pool on this machine."""

    kind = TargetKind.PROCESS
    title = "the process pool"

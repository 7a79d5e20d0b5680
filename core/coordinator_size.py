"""The coordinator's size: the memory it needs for a model, and so the size it is billed at.

The coordinator trains nothing, but it holds the model a few times over between epochs: the
global model, its outer snapshot and the outer optimizer's momentum (Local-SGD, DiLoCo), the
average being taken of the replicas' deltas, and a checkpoint being serialised. On a base of
the process itself (Python, Prefect, torch and the coordinator's modules: 284 MiB resident
measured here after their imports, rounded up for the run's own state and the data sample):

    needed = BASE_GB + MODEL_COPIES * parameter bytes

It is billed on-demand at the target's `coordinator_vcpu` and this memory
(`coordinator.run.context.RunContext.price_per_coordinator_s`): a coordinator at a worker's
size would make a plan's bill, and its spot discount, look worse than it is.
"""
from __future__ import annotations

import math

from core.errors import ZooidValueError
from core.stage_memory import GB
BASE_GB = 0.5
"""The coordinator process before any model (measured: 284 MiB after its imports)."""
MODEL_COPIES = 5
"""The model, its outer snapshot, the outer momentum, an average being taken, a checkpoint."""
SMALLEST_GB = 1.0
"""The least memory a coordinator is given when the target leaves it to the model."""


def coordinator_need_bytes(parameter_bytes: float) -> float:
    """Bytes a coordinator needs for a model of `parameter_bytes` bytes of parameters."""
    return BASE_GB * GB + MODEL_COPIES * float(parameter_bytes)


def coordinator_memory_gb(asked_gb: float | None, parameter_bytes: float) -> float:
    """The coordinator's memory in GB: `asked_gb` (the target's `coordinator_memory_gb`) when it
    holds the model, else refused in one line naming it; None: the whole GB that holds it, at
    least `SMALLEST_GB`."""
    need = coordinator_need_bytes(parameter_bytes)
    fits_gb = max(SMALLEST_GB, float(math.ceil(need / GB)))
    if asked_gb is None:
        return fits_gb
    if asked_gb * GB < need:
        raise ZooidValueError(
            "coordinator_memory_gb",
            f"{asked_gb:g} GB cannot hold the coordinator of a model of {parameter_bytes / 2**20:.0f} MiB of "
            f"parameters: about {need / GB:.1f} GB ({BASE_GB:g} GB of process and the model {MODEL_COPIES} "
            f"times over); give it at least {fits_gb:g} GB, or leave it empty to size it to the model")
    return float(asked_gb)

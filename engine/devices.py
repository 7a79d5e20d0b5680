"""A spec's `ComputeSpec` as torch objects: the device and the floating dtype a worker
trains in (the same rules for a Local-SGD replica and a pipeline stage)."""
from __future__ import annotations

import torch

from core.errors import ZooidValueError
from core.specs import ComputeSpec


def torch_device(compute: ComputeSpec) -> torch.device:
    """`compute.device`, or the GPU when there is one, else the CPU."""
    return torch.device(compute.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def torch_dtype(compute: ComputeSpec) -> torch.dtype:
    """`compute.dtype` as a floating torch dtype (float32 by default; tests train in float64
    to compare replicas with one process exactly)."""
    dtype = getattr(torch, compute.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ZooidValueError("compute.dtype", f"must name a floating dtype, got {compute.dtype!r}")
    return dtype


def to_compute(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Data for the model on `device`: floating tensors in the compute `dtype`, integer ones
    (class labels, token ids and token targets) as they are."""
    return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

"""The outer step of a Local-SGD round and the dtype its syncs travel in, as plain names and
numbers (standard library only), so that the job, the worker spec, the engine, the planner and
the report agree on them.

- `outer_optimizer`: `average` (K-AVG: the replicas' mean replaces the weights) or `nesterov`
  (DiLoCo: the round's outer gradient, Δ = θ_global − mean_i θ_i, drives a Nesterov step
  θ_global ← θ_global − outer_lr · (Δ + μ m'), m' = μ m + Δ). With outer_lr 1 and μ 0 it is
  `average`.
- `every_step`: with period 1, `average` and `float32`, `gradients` (default) or `parameters`.
- `sync_dtype`: `float32` (today's raw values), `bfloat16` (each value rounded to bf16) or
  `int8` (per block of `INT8_BLOCK` values, one scale max|x| / 127 in the tensor's dtype).
  Compressed syncs send each replica's change since the last sync with error feedback: the
  part rounding dropped is added to the next round's change (`comm.compression`).
"""
from __future__ import annotations

import math

OUTER_OPTIMIZERS = ("average", "nesterov")
SYNC_DTYPES = ("float32", "bfloat16", "int8")
EVERY_STEP = ("gradients", "parameters")
"""What replicas that sync every step (period 1, `average`, `float32`) average: their
gradients, in buckets during backward (DDP's way), or their weights and optimizer state
after the step (as at k > 1)."""
DEFAULT_BUCKET_MB = 25.0
"""MiB per gradient bucket (DDP's `bucket_cap_mb`)."""
INT8_BLOCK = 1024
"""Values that share one int8 scale."""
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
"""DiLoCo's published outer learning rate and Nesterov momentum."""


def wire_bytes(float32_bytes: float, sync_dtype: str) -> float:
    """Bytes a sync moves in `sync_dtype` for what takes `float32_bytes` in float32 (the
    planner's sync size; the measured one adds each piece's few-hundred-byte header)."""
    if sync_dtype == "float32":
        return float32_bytes
    if sync_dtype == "bfloat16":
        return float32_bytes / 2
    if sync_dtype == "int8":
        values = float32_bytes / 4
        return values + 4 * math.ceil(values / INT8_BLOCK)
    raise ValueError(f"sync_dtype: must be one of {', '.join(SYNC_DTYPES)}, got {sync_dtype!r}")


def is_default(outer_optimizer: str, sync_dtype: str) -> bool:
    """Whether a job syncs as K-AVG always did (the report then says nothing about it)."""
    return outer_optimizer == "average" and sync_dtype == "float32"


def averages_gradients(sync_period: int | None, outer_optimizer: str = "average", sync_dtype: str = "float32",
                       every_step: str = "gradients") -> bool:
    """Whether replicas average each step's gradients (in buckets while backward runs, DDP's
    way) rather than their parameters and optimizer state: every step (`sync_period` 1), K-AVG
    on a lossless wire, unless `every_step` asks for parameters. The optimizer state then
    needs no averaging, so a sync moves the parameters' size once."""
    return sync_period == 1 and is_default(outer_optimizer, sync_dtype) and every_step == "gradients"

"""Plain data that crosses process boundaries: what a worker is asked to do and what it reports.

Everything here is a frozen dataclass of JSON-able fields (`to_dict` / `from_dict`), so it
travels as Prefect parameters and results without pickle. No tensors: workers exchange
tensors through the store and report keys.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _from_dict(cls, d: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names})


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One worker's share of one epoch (Local-SGD replica `rank` of `world`)."""

    run_id: str
    """Run the worker belongs to; every key it touches lives under runs/<run_id>/."""
    epoch: int
    """0-based epoch index."""
    rank: int
    """Replica index, 0..world-1."""
    world: int
    """Number of replicas in this epoch."""
    store_url: str
    """Store URL (file://, redis://, s3://)."""
    model: str
    """Registry name or `package.module:factory`."""
    dataset: str
    """Dataset name (`digits`, `synthetic`, or an import path)."""
    subsets: tuple[int, ...]
    """Indices of the published training subsets this worker reads, in order."""
    steps: int
    """Optimizer steps this worker takes this epoch (the same on every replica)."""
    batch_size: int
    """Samples per step per worker."""
    lr: float
    optimizer: str = "sgd"
    """`sgd`, `momentum` (SGD with momentum 0.9) or `adam`."""
    sync_period: int | None = None
    """Local-SGD period k in steps; None = once at the end of the epoch."""
    seed: int = 0
    init_key: str = ""
    """Store key of the reference checkpoint to start from (model + optimizer state)."""
    out_key: str = ""
    """Store key where rank 0 writes the averaged reference checkpoint at epoch end."""
    sync_timeout_s: float = 120.0
    """How long a replica waits for its peers at a sync before failing."""
    evaluate: bool = True
    """Whether rank 0 evaluates the averaged model on the validation set."""
    attempt: int = 0
    """Relaunch attempt of this worker within the epoch (0 = first)."""
    extra: dict = field(default_factory=dict)
    """Strategy-specific settings (pipeline stage, cuts, micro-batches...)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkerSpec":
        return _from_dict(cls, d)


@dataclass(frozen=True, kw_only=True)
class WorkerResult:
    """What a worker reports back: metrics, timings and keys, never tensors."""

    run_id: str
    epoch: int
    rank: int
    started_at: float
    """Unix time the worker process began its work."""
    stopped_at: float
    train_loss: float
    """Mean training loss over this worker's steps."""
    samples: int
    """Training samples processed."""
    compute_s: float = 0.0
    sync_s: float = 0.0
    upload_s: float = 0.0
    download_s: float = 0.0
    bytes_synced: int = 0
    """Bytes this worker uploaded plus downloaded for synchronisation."""
    val_loss: float | None = None
    val_accuracy: float | None = None
    checkpoint_key: str = ""
    pid: int = 0
    host: str = ""
    iteration_s: float = 0.0
    """Steady-state seconds per iteration (`engine.iteration_clock`; 0 when too few ran)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkerResult":
        return _from_dict(cls, d)

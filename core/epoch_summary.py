"""One epoch of a run, as the coordinator records it: the typed row of the per-epoch history.

`coordinator.workers.epoch_run` builds it from the workers' `WorkerResult`s; the flow adds what is
known only after the epoch (the prediction in force, the bill predicted by now, the overhead,
the scaling policy's decision, the re-plan and the plan in force for the next epoch) as
fields, so nothing is dropped between the epoch and `summary.json`. Rescale, calibration,
re-plan, run terms, resume (`history.json`) and the report all read this one type.
`to_dict` / `from_dict` are its JSON form (unknown keys of an older history are dropped).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from core.specs import JsonSpec


@dataclass(kw_only=True)
class Rescale(JsonSpec):
    """The scaling policy's decision after an epoch."""

    STRICT = False
    workers: int
    lr: float
    reason: str = ""


@dataclass(kw_only=True)
class Replan(JsonSpec):
    """After an epoch: the calibration fitted, whether the plan changed, and why."""

    STRICT = False
    calibration: dict = field(default_factory=dict)
    switched: bool = False
    reason: str = ""
    predicted_epoch_s: float | None = None
    to: dict | None = None
    """The shape switched to (strategy, data_parallel, stages) when `switched`."""


@dataclass(kw_only=True)
class EpochSummary(JsonSpec):
    """One row of the per-epoch history."""

    STRICT = False
    epoch: int
    workers: int
    stages: int = 1
    attempt: int = 0
    """The run_epoch task's attempt that completed it (0: the first)."""
    lr: float | None = None
    train_loss: float
    val_loss: float | None = None
    val_accuracy: float | None = None
    """Class targets (`engine.objective`); None for token targets and a custom loss."""
    val_perplexity: float | None = None
    """Token targets: exp of the mean validation token loss."""
    val_token_accuracy: float | None = None
    """Token targets: the fraction of scored validation positions predicted."""
    samples: int = 0
    """Samples the epoch's final attempts trained (a resumed epoch: what was left)."""
    samples_once: bool | None = None
    """Local-SGD: whether the workers' history records add up to every training sample once
    (`coordinator.workers.epoch_samples`); None where it is not checked (pipelines)."""
    tokens: int = 0
    """Token targets: tokens trained this epoch (samples x positions per sample, the input
    tokens read; `core.specs.WorkerResult.tokens`); 0 otherwise."""
    seconds: float
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    """`tokens` over the epoch's wall `seconds`."""
    cost_usd: float = 0.0
    predicted_iteration_s: float | None = None
    measured_iteration_s: float | None = None
    predicted_epoch_s: float | None = None
    """The plan's epoch time in force for this epoch, beside `seconds` measured."""
    predicted_cost_so_far_usd: float | None = None
    """The bill the plan in force predicted by the end of this epoch."""
    bytes_synced: int = 0
    """Bytes the epoch's workers moved to average across replicas (each worker's uploads plus
    downloads, summed). 0 in an epoch of one replica, a pipeline of one replica's stages
    included: activations and gradients between stages are not counted here."""
    store_ops: dict = field(default_factory=dict)
    """The store requests the epoch's workers reported, by store and kind, with their bytes
    (`core.specs.WorkerResult.store_ops` summed); a failed attempt reports none."""
    checkpoint_key: str = ""
    compute_s: float = 0.0
    """The slowest worker's compute seconds."""
    sync_s: float = 0.0
    """The slowest worker's sync seconds."""
    critical_busy_s: float | None = None
    """The slowest worker's compute + sync seconds: the epoch's wall time minus this is overhead."""
    overhead_s: float | None = None
    """Wall time beyond the epoch's steps: dispatch, data, validation, checkpoint."""
    prestarted: bool = False
    """Whether this epoch's workers were launched during the previous epoch."""
    startup: dict = field(default_factory=dict)
    """Worker start-up seconds hidden behind the previous epoch vs exposed (and idle)."""
    relaunches: list = field(default_factory=list)
    """Failed worker attempts of this epoch and how each was classified."""
    worker_pids: dict = field(default_factory=dict)
    """Rank -> process id of the worker that completed it (warm workers keep theirs)."""
    rescale: Rescale | None = None
    """The scaling policy's decision after this epoch (None after the last)."""
    replan: Replan | None = None
    """After this epoch: the calibration fitted, whether the plan changed, and why."""
    plan: dict = field(default_factory=dict)
    """The plan in force for the next epoch (`core.plan.Plan.to_dict`)."""

    def __post_init__(self):  # the JSON form of the groups, as an older history or a test writes them
        if isinstance(self.rescale, dict):
            self.rescale = Rescale.from_dict(self.rescale)
        if isinstance(self.replan, dict):
            self.replan = Replan.from_dict(self.replan) if self.replan else None

    @property
    def exposed_startup_s(self) -> float:
        """Worker start-up the epoch waited for (not hidden behind the previous epoch)."""
        return float(self.startup.get("exposed_s", self.startup.get("critical_exposed_s", 0.0)) or 0.0)

    @property
    def loss(self) -> float:
        """Validation loss where measured, else training loss."""
        return self.val_loss if self.val_loss is not None else self.train_loss


def run_token_figures(epochs: list[EpochSummary], cost_usd: float) -> dict:
    """A run's figures in tokens (`RunSummary`): tokens trained over all its epochs, tokens per
    second of the epochs' wall time, and dollars per million tokens trained (the whole bill,
    `cost_usd`, over them); empty when no epoch trained tokens (class targets, a custom loss)."""
    tokens = sum(e.tokens for e in epochs)
    if not tokens:
        return {}
    seconds = sum(e.seconds for e in epochs)
    return {"tokens_trained": tokens, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "usd_per_million_tokens": cost_usd / (tokens / 1e6)}

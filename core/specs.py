"""Plain data that crosses process boundaries: what a worker is asked to do and what it reports.

Everything here is a frozen dataclass of JSON-able fields (`to_dict` / `from_dict`), so it
travels as Prefect parameters, store commands and results without pickle. No tensors:
workers exchange tensors through the store and report keys.

A `WorkerSpec` is the common part of one worker's epoch plus small typed groups: `stage`
(`StageSpec`: which pipeline stage worker it is; None for a Local-SGD replica), `sync`
(`SyncSpec`: the collective and its knobs), `compute` (`ComputeSpec`: device, dtype,
threads, model arguments), `data` (`DataSpec`: where its shards are, how many MB it keeps) and
`warm` (`WarmSpec`: set only on a warm worker's launch spec).
`WorkerSpec.from_dict` refuses a key it does not know, naming it, so a typo (or a spec from
another Zooid version) fails at the worker's door instead of silently training something
else. `WorkerResult.from_dict` drops unknown keys on purpose: a result is read, not obeyed,
and a newer worker's extra metric must not fail an epoch that trained.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from core.errors import ZooidValueError
from core.kinds import PipelineSchedule
from core.outer_sync import (DEFAULT_BUCKET_MB, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, EVERY_STEP,
                             OUTER_OPTIMIZERS, SYNC_DTYPES)

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of a dataclass (cached)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _members(tp: Any) -> tuple[Any, ...]:
    """The alternatives of `X | Y`, or (tp,)."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _matches(value: Any, tp: Any) -> bool:
    """Whether `value` is a `tp` (the annotation forms these specs use)."""
    if len(_members(tp)) > 1:
        return any(_matches(value, t) for t in _members(tp))
    if tp is type(None):
        return value is None
    if typing.get_origin(tp) is tuple:
        return isinstance(value, tuple) and all(_matches(v, typing.get_args(tp)[0]) for v in value)
    if tp is dict or typing.get_origin(tp) is dict:
        return isinstance(value, dict)
    if tp in (int, float):  # a bool is no count, and an int is a fine float
        return isinstance(value, (int, tp)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _check_types(obj: Any, prefix: str, names: tuple[str, ...] | None = None) -> None:
    """Raise ZooidValueError naming `<prefix>.<field>` for the first field of `obj` whose
    value is not of its annotated type."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if names is None or f.name in names:
            value = getattr(obj, f.name)
            if not _matches(value, hints[f.name]):
                raise ZooidValueError(f"{prefix}{f.name}", f"must be {hints[f.name]}, got {value!r}")


def _positive(obj: Any, prefix: str, names: tuple[str, ...], *, zero_ok: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and (value < 0 if zero_ok else value <= 0):
            raise ZooidValueError(f"{prefix}{name}", f"must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")


def _decode(tp: Any, value: Any, path: str) -> Any:
    """A JSON value as the annotated type: objects become nested specs, lists tuples."""
    if value is None:
        return None
    kinds = [t for t in _members(tp) if t is not type(None)]
    target = kinds[0] if len(kinds) == 1 else None
    if target is not None and dataclasses.is_dataclass(target):
        if not isinstance(value, dict):
            raise ZooidValueError(path, f"must be an object of {target.__name__} fields, got {value!r}")
        return _from_dict(target, value, f"{path}.")
    if target is not None and typing.get_origin(target) is tuple and isinstance(value, list):
        return tuple(value)
    return value


def _from_dict(cls, d: dict[str, Any], prefix: str = "", strict: bool = True):
    """`cls` from its JSON dict; `strict` refuses unknown keys, naming the first."""
    if not isinstance(d, dict):
        raise ZooidValueError(prefix.rstrip(".") or cls.__name__, f"must be a JSON object, got {d!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if strict:
        unknown = next((k for k in d if k not in fields), None)
        if unknown is not None:
            raise ZooidValueError(f"{prefix}{unknown}", f"unknown field of {cls.__name__} "
                                  f"(a typo, or a spec from another Zooid version)")
    for name, f in fields.items() if strict else ():
        if name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ZooidValueError(f"{prefix}{name}", f"is required in a {cls.__name__}")
    hints = _hints(cls)
    return cls(**{k: _decode(hints[k], v, f"{prefix}{k}") for k, v in d.items() if k in fields})


def _plain(value: Any) -> Any:
    """`dataclasses.asdict` output as plain JSON types (tuples as lists)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _to_dict(obj: Any) -> dict[str, Any]:
    return _plain(dataclasses.asdict(obj))


class JsonSpec:
    """Plain-JSON round trip of a spec dataclass: `to_dict` and `from_dict`, the nested groups
    rebuilt, unknown or missing keys refused with their JSON path (`PATH`: the group's prefix,
    e.g. `stage.`); `STRICT = False` drops unknown keys instead."""

    PATH: ClassVar[str] = ""
    STRICT: ClassVar[bool] = True

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return _from_dict(cls, d, cls.PATH, strict=cls.STRICT)


@dataclass(frozen=True, kw_only=True)
class StageSpec(JsonSpec):
    """One stage worker of a D x p pipeline (`engine.pipeline_executor`): which worker of
    which replica it is, and the pipeline's shape, the same on every worker of the epoch."""

    PATH = "stage."

    index: int
    """This stage worker's index w, 0..workers-1 (its model stage when chunks = 1)."""
    cuts: tuple[int, ...]
    """Child indices where model stages 1..p*v-1 begin (`engine.stages.split_stages`)."""
    microbatches: int
    """Micro-batches per iteration; the iteration's batch is `WorkerSpec.batch_size` rows."""
    replica: int = 0
    """This worker's pipeline replica, 0..replicas-1 (selects its data and sync rank)."""
    replicas: int = 1
    """D: replicas of the whole pipeline; each model stage's replicas sync every iteration."""
    chunks: int = 1
    """v: model stages per worker (>= 2 for `interleaved`, 1 for `gpipe` and `1f1b`); worker
    w holds model stages w, w + p, ..., so `len(cuts) + 1` must be a multiple of it."""
    schedule: str = PipelineSchedule.GPIPE
    """The named schedule (`gpipe`, `1f1b`, `interleaved`; `core.schedules`) run when
    `actions` is empty."""
    actions: tuple[str, ...] = ()
    """One action line per stage worker for one iteration (`core.schedules.parse_schedule`);
    empty = the lowered `schedule`."""
    val_chunk: int = 256
    """Validation rows per micro-batch."""

    @property
    def stages(self) -> int:
        """The number of model stages, p * v."""
        return len(self.cuts) + 1

    @property
    def workers(self) -> int:
        """p, the stage workers of one replica."""
        return self.stages // self.chunks

    def __post_init__(self):
        _check_types(self, "stage.")
        if self.chunks < 1 or self.stages % self.chunks:
            raise ZooidValueError("stage.chunks", f"must be >= 1 and divide the {self.stages} model "
                                  f"stages (len(cuts) + 1), got {self.chunks}")
        if not 0 <= self.index < self.workers:
            raise ZooidValueError("stage.index", f"must be in 0..{self.workers - 1}, got {self.index}")
        if self.microbatches < 1 or self.val_chunk < 1 or self.replicas < 1:
            raise ZooidValueError("stage.microbatches", "microbatches, val_chunk and replicas must be >= 1")
        if not 0 <= self.replica < self.replicas:
            raise ZooidValueError("stage.replica", f"must be in 0..{self.replicas - 1}, got {self.replica}")


@dataclass(frozen=True, kw_only=True)
class SyncSpec(JsonSpec):
    """How replicas average: the collective and its knobs (`engine.local_sgd`; a pipeline
    stage uses `collective` and `ring_host`)."""

    PATH = "sync."

    collective: str | None = None
    """`plain` (`comm.collectives`), `pipelined` (`comm.scatter_reduce`) or `ring` (direct
    torch.distributed ring, `comm.ring_allreduce`). None: the engine's default, `plain`
    for a Local-SGD replica, `pipelined` for a pipeline stage."""
    ring_host: str = "127.0.0.1"
    """Where rank 0 of a ring listens; `auto` publishes the worker's resolved address."""
    ring_timeout_s: float | None = None
    """Seconds for a Local-SGD ring's rendezvous and each sync; None: `sync_timeout_s`."""
    repost_s: float = 5.0
    """Re-post this round's and the previous round's pieces when a wait stalls this long
    (lost scratch keys); 0: never re-post."""
    checkpoint_every: int = 1
    """Write the Local-SGD sync checkpoint every n rounds (the last round always); 0: off,
    and with it single-replica relaunch."""
    checkpoint_s: float = 1.0
    """Over a ring, and over the store when every step averages gradients, write the sync
    checkpoint at most once per this many seconds (the last round always) instead of every
    `checkpoint_every` rounds; 0: by rounds. Written every step it would cost rank 0 a put
    per step while its peers wait (`engine.local_sgd_epoch.CheckpointCadence`)."""
    checkpoint_interval_s: float = 0.0
    """Over the store, for a sync with no error-feedback residuals (float32): write the sync
    checkpoint at the first round at least this many seconds after the last one (the last round
    always; the rounds since kept for a relaunch's replay, at most `REPLAY_KEPT_BYTES` of them)
    instead of every `checkpoint_every` rounds; 0: by rounds. The coordinator sets the plan's
    (`planners.checkpoint_cadence`)."""
    group: str = ""
    """Store prefix of the Local-SGD syncs; empty: `runs/<run>/sync/e<epoch>`."""
    outer_optimizer: str = "average"
    """A Local-SGD round's outer step (`core.outer_sync`): `average` (K-AVG) or `nesterov` (DiLoCo)."""
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    """The `nesterov` outer step's learning rate and momentum."""
    sync_dtype: str = "float32"
    """What a sync's pieces travel as: `float32`, `bfloat16` or `int8` (with error feedback)."""
    every_step: str = "gradients"
    """With `sync_period` 1, `average` and `float32`: `gradients` (averaged in buckets while
    backward runs, `engine.gradient_buckets`) or `parameters` (weights and optimizer state
    after the step). A pipeline stage always averages gradients."""
    bucket_mb: float = DEFAULT_BUCKET_MB
    """MiB of gradients per bucket when gradients are averaged."""

    def __post_init__(self):
        _check_types(self, "sync.")
        _positive(self, "sync.", ("ring_timeout_s", "outer_lr", "bucket_mb"))
        if self.every_step not in EVERY_STEP:
            raise ZooidValueError("sync.every_step", f"must be one of {', '.join(EVERY_STEP)}, got {self.every_step!r}")
        _positive(self, "sync.", ("repost_s", "checkpoint_every", "checkpoint_s", "checkpoint_interval_s"), zero_ok=True)
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ZooidValueError("sync.outer_optimizer", f"must be one of {', '.join(OUTER_OPTIMIZERS)}, "
                                  f"got {self.outer_optimizer!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ZooidValueError("sync.outer_momentum", f"must be in [0, 1), got {self.outer_momentum!r}")
        if self.sync_dtype not in SYNC_DTYPES:
            raise ZooidValueError("sync.sync_dtype", f"must be one of {', '.join(SYNC_DTYPES)}, got {self.sync_dtype!r}")


@dataclass(frozen=True, kw_only=True)
class ComputeSpec(JsonSpec):
    """Where and how a worker computes."""

    PATH = "compute."

    device: str = ""
    """torch device; empty: the GPU when there is one, else the CPU."""
    dtype: str = "float32"
    """Floating dtype of the model and inputs (tests train in float64 to compare exactly)."""
    threads: int | None = None
    """torch threads, set per epoch (the worker's own vCPUs); None: torch's default."""
    model_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the model factory (`engine.models.build_model`)."""

    def __post_init__(self):
        _check_types(self, "compute.")
        if self.threads is not None and self.threads < 1:
            raise ZooidValueError("compute.threads", f"must be a thread count >= 1, got {self.threads!r}")


@dataclass(frozen=True, kw_only=True)
class WarmSpec(JsonSpec):
    """What a warm worker is told at launch (`runtime.warm`)."""

    PATH = "warm."

    worker: str
    """Its name, `r<rank>-w<serial>`."""
    lease_s: float = 60.0
    """Stop when the lease has not changed for this long."""
    check_s: float = 1.0
    """Seconds between two reads of the lease."""
    grace_s: float = 30.0
    """After expiry, how long a busy training thread may go without a heartbeat before the
    process exits on its own."""
    progress_s: float = 15.0
    """Seconds between two status writes while only its progress changed (each is a billed
    PUT on a cloud store); the first status, and the notice's, are written at once."""
    notice_s: float = 0.0
    """The provider's notice on its capacity (a spot offer's `notice_s`; 0: none, or leave at
    once): on the notice the worker works on while its pool starts its successor, and leaves
    when released or `core.notice.work_through_s(notice_s)` after the notice."""

    def __post_init__(self):
        _check_types(self, "warm.")
        _positive(self, "warm.", ("lease_s", "check_s", "grace_s", "progress_s"))
        if self.notice_s < 0:
            raise ZooidValueError("warm.notice_s", f"must be >= 0 seconds, got {self.notice_s!r}")


@dataclass(frozen=True, kw_only=True)
class DataSpec(JsonSpec):
    """Where a worker reads its data shards (`engine.shards`), and how much of them it keeps."""

    PATH = "data."

    store: str = ""
    """A prepared dataset's store (a URL, or `block:<type slug>/<name>`); empty: the data this
    run staged, beside its checkpoints (`runs/<run_id>/data`)."""
    prefix: str = ""
    """The prepared dataset's key prefix in `store` (its root: empty)."""
    cache_mb: float | None = None
    """The most MB of shards (as stored) the worker keeps in memory between reads (the job's
    `data_cache_mb`); None: no bound."""

    def __post_init__(self):
        _check_types(self, "data.")
        if self.cache_mb is not None and not self.cache_mb > 0:
            raise ZooidValueError("data.cache_mb", f"must be > 0 MB or None, got {self.cache_mb!r}")


@dataclass(frozen=True, kw_only=True)
class WorkerSpec(JsonSpec):
    """One worker's share of one epoch: Local-SGD replica `rank` of `world`, or (with
    `stage`) one stage worker of a pipeline replica."""

    run_id: str
    """Run the worker belongs to; every key it touches lives under runs/<run_id>/."""
    epoch: int
    """0-based epoch index."""
    rank: int
    """Replica index, 0..world-1 (a pipeline's: replica * p + stage worker)."""
    world: int
    """Number of replicas in this epoch (a pipeline's: D * p)."""
    store_url: str
    """Store URL (file://, redis://, s3://)."""
    model: str
    """Registry name or `package.module:factory`."""
    dataset: str
    """Dataset name (`digits`, `synthetic`, or an import path)."""
    steps: int
    """Optimizer steps each replica takes in a fresh epoch of `world` replicas
    (`engine.epoch_order.epoch_steps`; the worker refuses another count). A worker continuing
    another world's phase of the epoch takes what its share of the rest holds."""
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
    resume: bool = False
    """Continue from the epoch's sync checkpoint even on attempt 0 (the coordinator resuming
    an epoch); a relaunch (`attempt > 0`) always tries to."""
    checkpoint_store: str = ""
    """Durable store URL for checkpoints and data when `store_url` is scratch-only; empty:
    `store_url`."""
    stage: StageSpec | None = None
    """The pipeline stage this worker runs; None: a Local-SGD replica."""
    sync: SyncSpec = field(default_factory=SyncSpec)
    """The collective among replicas."""
    compute: ComputeSpec = field(default_factory=ComputeSpec)
    """Device, dtype, threads, model arguments."""
    warm: WarmSpec | None = None
    """Set on a warm worker's launch spec: serve the run's epochs (`runtime.warm`)."""
    capacity: str = "on_demand"
    """The capacity this attempt runs on (`core.kinds.Capacity`: `on_demand` or `spot`); a
    spot worker leaves cleanly on the provider's notice (SIGTERM)."""
    loss: str = ""
    """The job's custom loss, `package.module:function(output, target) -> scalar`; empty:
    cross-entropy over the output's last dimension (`engine.objective`)."""
    data: DataSpec = field(default_factory=DataSpec)
    """Where the worker reads its shards: the run's staged data, or a prepared dataset."""
    subsets: tuple[int, ...] = ()
    """Unused: a replica's samples follow from the epoch's order (`engine.replica_data`), not
    from shards dealt to it; kept so that a spec written before parses."""

    def __post_init__(self):
        _check_types(self, "", ("resume", "checkpoint_store", "stage", "sync", "compute", "warm", "loss", "data"))


@dataclass(frozen=True, kw_only=True)
class WorkerResult(JsonSpec):
    """What a worker reports back: metrics, timings and keys, never tensors."""

    STRICT = False  # unknown keys are dropped (see the module docstring)

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
    """Class targets only (`engine.objective`)."""
    val_perplexity: float | None = None
    """Token targets only: exp of the mean validation token loss."""
    val_token_accuracy: float | None = None
    """Token targets only: the fraction of scored validation positions predicted."""
    tokens: int = 0
    """Token targets: tokens trained (positions per sample x samples, ignored positions
    included: the input tokens read); 0 otherwise."""
    checkpoint_key: str = ""
    pid: int = 0
    host: str = ""
    iteration_s: float = 0.0
    """Steady-state seconds per iteration (`engine.iteration_clock`; 0 when too few ran)."""
    store_ops: dict = field(default_factory=dict)
    """The store requests this worker made in the epoch, by kind, and their bytes, by store
    (`{Store.where: StoreOps.to_dict()}`, `core.store_ops`): on the run's store and on every
    other one it opened (`runtime.run_spec`); a warm worker's include its polling since its
    previous epoch."""


"""Deep validation of a `TrainJob`, before anything is provisioned.

Pydantic already refused wrong types, non-positive sizes and NaN; this step checks what needs
the registries, the dataset and the network: the model factory, the dataset and its size
against the batch, whether the model takes the dataset's samples and scores its classes (built
without weights, no training step: `engine.fit`, in one call), the strategy, the compute target, the billing offer and the store (pinged).
Every failure is a `ZooidValueError` naming the field. Nothing is written anywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from blocks.compute import ComputeTarget, memory_options_problem, resolve_target
from blocks.store_block import BLOCK_PREFIX
from clouds.registry import adapter_for, is_cloud, provider_for
from coordinator.run.job import TrainJob
from coordinator.run.stores import open_checked_store, resolve_durable_ref, resolve_store_ref
from core.coordinator_size import coordinator_memory_gb
from core.errors import ZooidValueError
from core.kinds import BUILTIN_TARGETS, PIPELINED_STRATEGIES, Capacity, Strategy
from planners.catalog import Offer, SpotOffer, get_offer, spot_offer

SUBSET_SIZE = 64
"""The fewest samples per staged data subset (KubeML's fixed-size subsets)."""

SUBSET_BYTES = 2**20
"""The stored size a staged subset aims at: a store that bills by request (S3, Azure Blob)
charges a subset's put and each read the same whatever its size, and at about a mebibyte an
object's transfer takes as long as the request's own latency, so smaller subsets mostly buy
requests (64 rows of a small sample are a few kilobytes)."""

_ITEM_BYTES = {"float32": 4, "int64": 8}


@dataclass(frozen=True)
class ResolvedJob:
    """A validated job with its references resolved."""

    job: TrainJob
    store_ref: str
    """A store URL, or `block:<type slug>/<name>` (workers load the block, so secrets stay in it)."""
    durable_ref: str
    """Where checkpoints, data subsets, history, ledger and summary live."""
    target_name: str
    target: ComputeTarget
    offer: Offer
    n_train: int
    n_val: int
    input_shape: tuple[int, ...]
    classes: int
    model_kwargs: dict = field(default_factory=dict)
    """The model factory's arguments that the dataset decides (`vocab_size`, `mask_token_id`:
    `engine.models.data_model_kwargs`); every place that builds the model passes them."""
    shared_parameters: tuple = ()
    """Parameters two top-level children hold (tied weights, `core.shared_parameters`): `auto`
    then plans Local-SGD only, and a pipeline is refused."""
    input_dtype: str = "float32"
    """The samples' inputs: `float32` rows or `int64` token ids (`profiling.sample`)."""
    target_shape: tuple[int, ...] = ()
    """Targets per sample: () for class labels, (T,) for a token per position."""
    target_dtype: str = "int64"
    """`int64` labels or token ids, `float32` values (a custom loss's)."""

    shard_rows: int = 0
    """Rows per shard of a prepared dataset (its manifest's); 0: the run stages the dataset."""
    spot: SpotOffer | None = None
    """The spot offer that shadows `offer` on the target (`planners.catalog.spot_offer`); None:
    the target has none (the job's capacity is then `on_demand`, or `auto` planning on-demand)."""
    parameter_bytes: int = 0
    """The model's parameters in bytes (`engine.fit.Fit.parameter_bytes`)."""
    coordinator_offer: Offer | None = None
    """The offer the coordinator is billed as (the target's `coordinator_offer`); None: `offer`."""
    coordinator_memory_gb: float = 1.0
    """The coordinator's memory (`core.coordinator_size.coordinator_memory_gb`)."""

    @property
    def coordinator_billed_as(self) -> Offer:
        """The offer the coordinator is billed as: the target's `coordinator_offer`, else `offer`."""
        return self.coordinator_offer or self.offer

    @property
    def price_per_coordinator_s(self) -> float:
        """Dollars per second of the coordinator: on-demand, at the target's `coordinator_vcpu`
        and `coordinator_memory_gb`, no GPU."""
        return self.coordinator_billed_as.price_per_s(self.target.coordinator_vcpu, self.coordinator_memory_gb, 0)

    @property
    def row_bytes(self) -> int:
        """One sample's stored bytes: its input and its target."""
        return (math.prod(self.input_shape) * _ITEM_BYTES[self.input_dtype]
                + math.prod(self.target_shape) * _ITEM_BYTES[self.target_dtype])

    @property
    def subset_size(self) -> int:
        """Rows per data subset (shard): a prepared dataset's own, else as many as fill
        `SUBSET_BYTES` and at least KubeML's fixed size (`SUBSET_SIZE`), fewer when needed so
        that every replica up to the job's `max_workers` gets at least one."""
        rows = max(SUBSET_SIZE, SUBSET_BYTES // max(1, self.row_bytes))
        return self.shard_rows or max(1, min(rows, self.n_train // self.job.max_workers))

    @property
    def n_subsets(self) -> int:
        """How many training subsets `provision` publishes."""
        return -(-self.n_train // self.subset_size)

    @property
    def n_val_subsets(self) -> int:
        """How many validation subsets `provision` publishes (of `subset_size` rows, as the training ones)."""
        return -(-self.n_val // self.subset_size)


def check_batch(job: TrainJob, n_train: int) -> None:
    """The batch against the training set (`batch_size`, and `workers` replicas of it), and a
    pipeline's batch split into whole micro-batches (`microbatches`)."""
    if job.batch_size > n_train:
        raise ZooidValueError("batch_size", f"{job.batch_size} is larger than the training set ({n_train} samples)")
    if job.workers * job.batch_size > n_train:
        raise ZooidValueError("workers", f"{job.workers} workers x batch {job.batch_size} exceed the "
                              f"training set ({n_train} samples)")
    if job.strategy in PIPELINED_STRATEGIES and job.microbatches is not None and job.batch_size % job.microbatches:
        raise ZooidValueError("microbatches", f"{job.microbatches} does not divide batch_size {job.batch_size}")


def check_strategy(job: TrainJob) -> None:
    """The strategy is one Zooid runs (`core.kinds.Strategy`)."""
    if job.strategy not in tuple(Strategy):
        raise ZooidValueError("strategy", f"{job.strategy!r} is not available yet; use one of "
                              f"{', '.join(Strategy)}")


def check_worker_sizes(target: ComputeTarget, offer: Offer) -> tuple[float, ...]:
    """The worker sizes the plan may choose among (`ComputeTarget.memory_options`); a
    ZooidValueError naming `worker_memory_options_gb` for a size that is not a positive
    finite number, or for several sizes of an offer billed per whole instance (a VM has one
    size)."""
    problem = memory_options_problem(target.worker_memory_options_gb)
    if problem:
        raise ZooidValueError("worker_memory_options_gb", problem.removeprefix("worker_memory_options_gb: "))
    sizes = target.memory_options()
    if len(sizes) > 1 and "instance_hour" in offer.unit_prices:
        raise ZooidValueError("worker_memory_options_gb", f"offer {offer.name} is billed per whole instance "
                              f"({offer.memory_gb:g} GB); memory tiers need a container or function offer")
    return sizes


def check_reachable_from_workers(target: ComputeTarget, target_name: str, store_ref: str, durable_ref: str,
                                 data_ref: str = "") -> None:
    """Workers in containers (docker and the clouds) reach their stores over the network: a
    directory on this machine is refused, naming `store`, `durable_store` or `dataset` (a
    prepared one, `data_ref`) and the store the target's workers should use (its provider's
    `store_suggestion`: ACI Azure Blob, the others S3 or Redis)."""
    if not is_cloud(target):
        return
    suggestion = provider_for(target.kind).store_suggestion
    for name, ref in (("store", store_ref), ("durable_store", durable_ref), ("dataset", data_ref)):
        if ref.startswith("file://"):
            raise ZooidValueError(name, f"{ref} is a directory on this machine, which workers in containers "
                                  f"(target {target_name!r}) cannot reach; use {suggestion}")


def worker_image(target: ComputeTarget, pool) -> str | None:
    """The image a worker of `target` runs: the target's, else its pool's default."""
    image = target.job_variables.get("image") or target.image
    if image:
        return image
    props = (pool.base_job_template or {}).get("variables", {}).get("properties", {})
    return props.get("image", {}).get("default")


def check_target_ready(resolved: "ResolvedJob") -> None:
    """Before anything is rented: a pool target's worker deployment and pool exist, and the
    provider can start a worker (`CloudAdapter.preflight`: e.g. the engine answers and holds the
    image). One line naming `target` (or `image`) and the command that sets it up."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    target, name = resolved.target, resolved.target_name
    if not target.remote:
        return
    setup = provider_for(target.kind).setup_command()
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(target.worker_deployment or "")
        except (ObjectNotFound, ValueError):
            raise ZooidValueError("target", f"{name!r} is not set up: no worker deployment "
                                  f"{target.worker_deployment!r}; {setup} creates it") from None
        try:
            pool = client.read_work_pool(target.work_pool or "")
        except (ObjectNotFound, ValueError):
            raise ZooidValueError("target", f"{name!r} is not set up: no work pool {target.work_pool!r}; "
                                  f"{setup} creates it") from None
    image, adapter = worker_image(target, pool), adapter_for(target)
    if adapter is not None:
        adapter.preflight(image)


def validate_job(job: TrainJob, *, check_store: bool = True) -> ResolvedJob:
    """Check everything about `job` that pydantic cannot; raise ZooidValueError naming the field."""
    model_and_data = check_model_and_data(job)
    target, offer = check_target_and_offer(job)
    spot = check_capacity(job, target, offer)
    coordinator = check_coordinator(target, model_and_data["parameter_bytes"])
    store_ref, durable_ref = check_stores(job, target, ping=check_store)
    return ResolvedJob(job=job, store_ref=store_ref, durable_ref=durable_ref, target_name=job.target, target=target,
                       offer=offer, spot=spot, **coordinator, **model_and_data)


def validate_without_api(job: TrainJob) -> None:
    """`validate_job`'s checks that need no Prefect API, for a command that has not started its
    stack yet (`make run`): a target or store named by a block is left to the run, which looks it
    up; the rest is checked, store URLs pinged. ZooidValueError naming the field."""
    model_and_data = check_model_and_data(job)
    if job.target not in BUILTIN_TARGETS:
        return
    target, offer = check_target_and_offer(job)
    check_capacity(job, target, offer)
    check_coordinator(target, model_and_data["parameter_bytes"])
    check_stores(job, target, ping=True, blocks=False)


def check_model_and_data(job: TrainJob) -> dict:
    """The model, the dataset, whether one takes the other, the batch against the data, the
    strategy and the pipeline's shape: `ResolvedJob`'s fields about them (n_train, n_val, input
    shape, classes, `model_kwargs`, `shared_parameters`, the data's form, `shard_rows`)."""
    # torch: `make up` and bootstrap import this module (via coordinator.run.context) without it
    from coordinator.run.job_data import job_sample
    from engine.fit import fit_model
    from engine.models import resolve_model

    resolve_model(job.model)  # before any data is read
    sample = job_sample(job)  # a prepared dataset: its manifest and first shards only, never loaded whole
    check_prepared(job, sample.manifest)
    # a model that cannot take the data is refused before anything is rented
    fit = fit_model(job.model, job.dataset, sample.data, sample.classes, seed=job.seed, loss=job.loss,
                    objective=sample.objective or job.objective, pipelined=job.strategy in PIPELINED_STRATEGIES,
                    stages=job.stages)
    check_batch(job, sample.n_train)
    check_strategy(job)
    return {"n_train": sample.n_train, "n_val": sample.n_val, "input_shape": tuple(sample.data.train_x.shape[1:]),
            "classes": sample.classes, "model_kwargs": fit.model_kwargs, "shared_parameters": fit.shared_parameters,
            "shard_rows": sample.shard_rows, "parameter_bytes": fit.parameter_bytes, **data_form(sample.data)}


TEXT_FIELDS = ("tokenizer", "objective", "seq_len")
"""The job's text settings, which a prepared text dataset fixed when it was prepared."""


def check_prepared(job: TrainJob, manifest) -> None:
    """A prepared dataset (its `manifest`; None: a dataset loaded whole, nothing to check) against
    the job: enough training shards for `max_workers` replicas, and no text setting that
    contradicts the one it was prepared with (a field left at its default follows the dataset).
    One line naming the field."""
    if manifest is None:
        return
    if manifest.n_subsets < job.max_workers:
        raise ZooidValueError("dataset", f"{job.dataset} has {manifest.n_subsets} training shards, fewer than "
                              f"max_workers={job.max_workers} replicas need; prepare it again with subset_size "
                              f"<= {max(1, manifest.n_train // job.max_workers)}")
    prepared = (manifest.settings or {}).get("text") or {}
    for name in TEXT_FIELDS:
        mine, default = getattr(job, name), TrainJob.model_fields[name].default
        if name in prepared and mine != default and mine != prepared[name]:
            raise ZooidValueError(name, f"{mine!r}, but {job.dataset} was prepared with {name}={prepared[name]!r}; "
                                  "leave it out, or prepare the dataset again")


def data_form(data) -> dict:
    """What a profile's synthetic batch must look like (`ResolvedJob.input_dtype`, `target_shape`,
    `target_dtype`)."""
    # torch: `make up` and bootstrap import this module (via coordinator.run.context) without it
    from profiling.sample import input_dtype_of, target_dtype_of

    return {"input_dtype": input_dtype_of(data.train_x), "target_shape": tuple(data.train_y.shape[1:]),
            "target_dtype": target_dtype_of(data.train_y)}


def check_target_and_offer(job: TrainJob) -> tuple[ComputeTarget, Offer]:
    """The compute target (a block name is loaded from the Prefect API) with the job's worker
    size, and the offer its workers are billed as."""
    try:
        target = resolve_target(job.target)
    except ValueError as exc:
        raise ZooidValueError("target", str(exc).removeprefix("target: ")) from None
    sizes = {k: getattr(job, k) for k in ("worker_vcpu", "worker_memory_gb") if getattr(job, k) is not None}
    if sizes:
        target = target.model_copy(update=sizes)
    try:
        offer = get_offer(job.offer or target.offer)
    except ValueError as exc:
        raise ZooidValueError("offer", str(exc).removeprefix("offer: ")) from None
    check_worker_sizes(target, offer)
    return target, offer


def check_coordinator(target: ComputeTarget, parameter_bytes: int) -> dict:
    """The coordinator's offer and memory (`ResolvedJob` fields): the target's
    `coordinator_offer` (one line naming it when the catalog has none) and a memory that
    holds the model (`core.coordinator_size`)."""
    offer = None
    if target.coordinator_offer:
        try:
            offer = get_offer(target.coordinator_offer)
        except ValueError as exc:
            raise ZooidValueError("coordinator_offer", str(exc).removeprefix("offer: ")) from None
    return {"coordinator_offer": offer,
            "coordinator_memory_gb": coordinator_memory_gb(target.coordinator_memory_gb, parameter_bytes)}


def check_capacity(job: TrainJob, target: ComputeTarget, offer: Offer) -> SpotOffer | None:
    """The spot offer the job's workers may rent on `target` (`planners.catalog.spot_offer`);
    `capacity=spot` on a target with none (inline, the process pool, a GPU or VM offer) is
    refused in one line naming `capacity`, before anything is started; so are `spot_spares` on
    on-demand capacity."""
    spot = spot_offer(offer.name, target.kind)
    if job.capacity == Capacity.SPOT and spot is None:
        raise ZooidValueError("capacity", f"spot: target {job.target!r} ({target.kind}, offer {offer.name}) has no "
                              "spot offer; spot runs on ecs and docker (Fargate Spot), aci (ACI Spot) and k8s "
                              "(a spot node pool) with a CPU offer; use on_demand or auto")
    if job.spot_spares and job.capacity == Capacity.ON_DEMAND:
        raise ZooidValueError("spot_spares", f"{job.spot_spares}: spares stand in for preempted spot workers; "
                              "use capacity spot or auto, or spot_spares 0")
    return spot


def check_stores(job: TrainJob, target: ComputeTarget, *, ping: bool = True, blocks: bool = True) -> tuple[str, str]:
    """The store and durable store references, reachable from the target's workers; with `ping`,
    opened and pinged (`blocks=False`: a block-named store is not, it needs the Prefect API)."""
    store_ref = resolve_store_ref(job.store)
    durable_ref = resolve_durable_ref(job.durable_store, store_ref)
    check_reachable_from_workers(target, job.target, store_ref, durable_ref, job.dataset)
    if ping:
        for name, ref in (("store", store_ref), ("durable_store", durable_ref)):
            if (name == "durable_store" and ref == store_ref) or (not blocks and ref.startswith(BLOCK_PREFIX)):
                continue
            try:
                open_checked_store(ref).close()
            except ZooidValueError as exc:
                raise ZooidValueError(name, str(exc).removeprefix("store: ")) from None
    return store_ref, durable_ref

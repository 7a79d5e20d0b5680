"""Deep validation of a `TrainJob`, before anything is provisioned.

Pydantic already refused wrong types, non-positive sizes and NaN; this step checks what needs
the registries, the dataset and the network: the model factory, the dataset and its size
against the batch, whether the model takes the dataset's samples and scores its classes (built
without weights, no training step), the strategy, the compute target, the billing offer and the store (pinged).
Every failure is a `ZooidValueError` naming the field. Nothing is written anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from blocks.compute import ComputeTarget, memory_options_problem, resolve_target
from blocks.store_block import BLOCK_PREFIX, block_ref
from blocks.store_refs import is_store_url, load_store_block, open_store_ref
from clouds.registry import adapter_for, is_cloud, provider_for
from comm.store_dir import default_store_url, path_from_url
from coordinator.run.job import TrainJob
from core.errors import StoreError, ZooidValueError
from core.kinds import BUILTIN_TARGETS, PIPELINED_STRATEGIES, Strategy
from core.shared_parameters import shared_across
from planners.catalog import Offer, get_offer

SUBSET_SIZE = 64
"""Samples per published data subset (KubeML's fixed-size subsets)."""


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

    @property
    def subset_size(self) -> int:
        """Rows per data subset (shard): a prepared dataset's own, else KubeML's fixed size
        (`SUBSET_SIZE`), smaller when needed so that every replica up to the job's
        `max_workers` gets at least one."""
        return self.shard_rows or max(1, min(SUBSET_SIZE, self.n_train // self.job.max_workers))

    @property
    def n_subsets(self) -> int:
        """How many training subsets `provision` publishes."""
        return -(-self.n_train // self.subset_size)


def resolve_store_ref(store: str) -> str:
    """The store reference workers receive: an absolute URL, or `block:<type slug>/<name>` for
    a block named `<name>` (a `zooid-store`), `<type slug>/<name>` or already a reference."""
    if not store:
        return default_store_url()
    if is_store_url(store):
        if store.startswith("file://") or "://" not in store:
            return "file://" + str(path_from_url(store).resolve())
        return store
    return block_ref(store)


def resolve_durable_ref(durable_store: str, store_ref: str) -> str:
    """The durable store: as given; else the run's store, unless that is Redis (scratch that
    a restart may empty), in which case the local directory store."""
    if durable_store:
        return resolve_store_ref(durable_store)
    if store_ref.startswith(("redis://", "rediss://")):
        return default_store_url()
    return store_ref


def open_checked_store(store_ref: str):
    """Open the store and ping it; unreachable or unknown -> ZooidValueError("store")."""
    try:
        if store_ref.startswith(BLOCK_PREFIX):
            try:
                load_store_block(store_ref)
            except Exception as exc:
                raise ZooidValueError("store", f"no store block named {store_ref[len(BLOCK_PREFIX):]!r} "
                                      f"and not a URL (file://, redis://, s3://, az://): {type(exc).__name__}") from None
        store = open_store_ref(store_ref)
        store.ping()
    except ZooidValueError:
        raise
    except (StoreError, OSError, ValueError) as exc:
        raise ZooidValueError("store", f"cannot reach {store_ref.split('@')[-1]}: {exc}") from None
    return store


def check_pipeline_shape(job: TrainJob, model_kwargs: dict | None = None) -> None:
    """A pipeline needs a model of at least `stages` top-level layers, none of whose parameters
    two children share (tied weights: refused naming the parameter), and a batch that splits
    into whole micro-batches. The model is built on `meta` (`engine.models.shape_model`)."""
    # torch: `make up` and bootstrap import this module (via coordinator.run.context) without it
    from engine.models import shape_model
    from engine.stages import sequential_children, shared_parameters

    model = shape_model(job.model, job.seed, **(model_kwargs or {}))
    children = sequential_children(model)  # names the model if unsplittable
    problem = shared_across(shared_parameters(model), len(children))
    if problem:
        raise ZooidValueError("model", f"{job.model}: {problem}")
    if job.stages is not None and not 2 <= job.stages <= len(children):
        raise ZooidValueError("stages", f"must be 2..{len(children)} for {job.model} "
                              f"({len(children)} top-level layers), got {job.stages}")
    if job.microbatches is not None and job.batch_size % job.microbatches:
        raise ZooidValueError("microbatches", f"{job.microbatches} does not divide batch_size {job.batch_size}")


def _shape_text(shape) -> str:
    return "x".join(str(d) for d in shape) or "a scalar"


def check_model_fits(job: TrainJob, data, classes: int, objective: str | None = None) -> tuple[dict, tuple]:
    """The model takes the dataset's samples and its outputs can be scored against the targets
    (`[B, C]` against `[B]`, `[B, T, V]` against `[B, T]`; not checked with a custom `loss`):
    built without its weights (`engine.models.model_fit`: the `meta` device, one row on the CPU,
    no gradients), on this machine, before anything is rented, with the arguments the dataset
    decides (`engine.models.data_model_kwargs`: a language model's vocabulary and mask token).
    Token inputs are checked first (`engine.models.check_token_inputs`: ids against the
    embedding, `seq_len` against the positions, `mlm` against the mask token). A mismatch is
    one line naming `model` and `dataset`, their shapes, and the registry models that fit the
    dataset. `objective`: the data's own (a prepared text dataset's), else the job's.
    Returns the model's arguments and its shared parameters (`ResolvedJob`)."""
    # torch: `make up` and bootstrap import this module (via coordinator.run.context) without it
    from engine.stages import shared_parameters
    from engine.models import (check_token_inputs, data_model_kwargs, dataset_model_kwargs, model_fit,
                               models_that_fit, shape_model)

    kwargs = data_model_kwargs(job.model, data)
    try:
        model = shape_model(job.model, job.seed, **kwargs)
    except ZooidValueError:
        raise
    except Exception:  # a model that cannot be built: model_fit below says why, naming the pair
        model = None
    if model is not None:
        check_token_inputs(model, job.model, data, objective or job.objective)
    sample = data.train_x[:1]
    target = None if job.loss else data.train_y[:1]
    scored = None if job.loss else classes  # a custom loss scores outputs of any shape
    problem, expected = model_fit(job.model, sample, scored, job.seed, target=target, model_kwargs=kwargs)
    if problem is None:
        return kwargs, shared_parameters(model) if model is not None else ()
    fit = [m for m in models_that_fit(sample, scored, target=target, data_kwargs=dataset_model_kwargs(data))
           if m != job.model]
    takes = f"; {job.model} takes {expected}" if expected else ""
    scores = (f"targets {_shape_text(target.shape[1:])} of {classes} token ids" if target is not None
              and target.dim() > 1 else f"{classes} classes")
    raise ZooidValueError("model", f"{job.model} does not fit dataset {job.dataset} (a sample is "
                          f"{_shape_text(sample.shape[1:])}, {scores}{takes}): {problem}; registry "
                          f"models that fit {job.dataset}: {', '.join(fit) if fit else 'none'}")


def check_loss(job: TrainJob, data, model_kwargs: dict) -> None:
    """The job's custom `loss` imports, is a Python function outside the standard library, and
    scores the model's output for the first two training samples against their targets,
    returning one scalar (two rows: a loss per sample is caught too; `engine.objective.
    check_custom_loss`): the model built with its weights on the CPU, one forward without
    gradients. ZooidValueError naming `loss`."""
    # torch: `make up` and bootstrap import this module (via coordinator.run.context) without it
    import torch
    from engine.models import build_model
    from engine.objective import check_custom_loss, resolve_loss

    resolve_loss(job.loss)
    model = build_model(job.model, job.seed, **model_kwargs).eval()
    rows = data.train_x[:2]
    with torch.no_grad():
        output = model(rows if rows.is_floating_point() else rows.long())
    check_custom_loss(job.loss, output, data.train_y[:2])


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
    adapter = adapter_for(target)
    if adapter is not None:
        adapter.preflight(worker_image(target, pool))


def validate_job(job: TrainJob, *, check_store: bool = True) -> ResolvedJob:
    """Check everything about `job` that pydantic cannot; raise ZooidValueError naming the field."""
    n_train, n_val, input_shape, classes, model_facts = check_model_and_data(job)
    target, offer = check_target_and_offer(job)
    store_ref, durable_ref = check_stores(job, target, ping=check_store)
    return ResolvedJob(job=job, store_ref=store_ref, durable_ref=durable_ref, target_name=job.target, target=target,
                       offer=offer, n_train=n_train, n_val=n_val, input_shape=input_shape, classes=classes,
                       **model_facts)


def validate_without_api(job: TrainJob) -> None:
    """`validate_job`'s checks that need no Prefect API, for a command that has not started its
    stack yet (`make run`): a target or store named by a block is left to the run, which looks it
    up; the rest is checked, store URLs pinged. ZooidValueError naming the field."""
    check_model_and_data(job)
    if job.target not in BUILTIN_TARGETS:
        return
    target, _ = check_target_and_offer(job)
    check_stores(job, target, ping=True, blocks=False)


def check_model_and_data(job: TrainJob) -> tuple[int, int, tuple[int, ...], int, dict]:
    """The model, the dataset, whether one takes the other, the batch against the data, the
    strategy and the pipeline's shape: (n_train, n_val, input shape, classes, and the model's
    `ResolvedJob` fields: `model_kwargs`, `shared_parameters`)."""
    # torch: `make up` and bootstrap import this module (via coordinator.run.context) without it
    from coordinator.run.job_data import is_prepared, load_job_dataset, prepared_sample, text_settings
    from engine.datasets import validate_dataset
    from engine.models import resolve_model
    from engine.objective import target_classes

    resolve_model(job.model)
    facts, objective = {}, None
    if is_prepared(job.dataset):  # its manifest and first shards only: never loaded whole
        manifest, data = prepared_sample(job.dataset)
        check_prepared(job, manifest)
        n_train, n_val, classes = manifest.n_train, manifest.n_val, manifest.classes
        facts, objective = {"shard_rows": manifest.subset_size}, manifest.text.objective if manifest.text else None
    else:
        validate_dataset(job.dataset, text_settings(job))
        data = load_job_dataset(job, resolve_durable_ref(job.durable_store, resolve_store_ref(job.store)))
        n_train, n_val = len(data.train_y), len(data.val_y)
        classes = target_classes(data.train_y, data.val_y)  # token targets: the vocabulary they use
    # a model that cannot take the data is refused before anything is rented
    model_kwargs, shared = check_model_fits(job, data, classes, objective)
    if job.loss:
        check_loss(job, data, model_kwargs)
    if job.batch_size > n_train:
        raise ZooidValueError("batch_size", f"{job.batch_size} is larger than the training set ({n_train} samples)")
    if job.workers * job.batch_size > n_train:
        raise ZooidValueError("workers", f"{job.workers} workers x batch {job.batch_size} exceed the "
                              f"training set ({n_train} samples)")
    if job.strategy not in tuple(Strategy):
        raise ZooidValueError("strategy", f"{job.strategy!r} is not available yet; use one of "
                              f"{', '.join(Strategy)}")
    if job.strategy in PIPELINED_STRATEGIES:
        check_pipeline_shape(job, model_kwargs)
    return n_train, n_val, tuple(data.train_x.shape[1:]), classes, {"model_kwargs": model_kwargs,
                                                                     "shared_parameters": shared,
                                                                     **data_form(data), **facts}


TEXT_FIELDS = ("tokenizer", "objective", "seq_len")
"""The job's text settings, which a prepared text dataset fixed when it was prepared."""


def check_prepared(job: TrainJob, manifest) -> None:
    """A prepared dataset against the job: enough training shards for `max_workers` replicas,
    and no text setting that contradicts the one it was prepared with (a field left at its
    default follows the dataset). One line naming the field."""
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

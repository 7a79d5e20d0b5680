"""The job's dataset as the coordinator loads and stages it.

A `text:` dataset needs more than its name: the job's `tokenizer`, `objective` and `seq_len`
(`engine.text_data.TextSettings`), the durable store that keeps trained tokenizers, and, for a
corpus in a store block, the block's opener (`blocks.store_refs.open_store_ref`: the worker side
never loads Prefect blocks, so the coordinator reads the corpus and publishes it tokenized).
Validation (`coordinator.run.validate`, through `job_sample`) and staging (`coordinator.workers.staging`)
both load it here.

A dataset prepared into a bucket (`flows.prepare`), named by its store URL or block, is never
loaded: the coordinator reads its manifest and, for the model checks, its first shards
(`prepared_sample`); the workers read their shards from it themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

from blocks.store_block import BLOCK_PREFIX
from blocks.store_refs import open_store_ref
from comm.store import Store
from coordinator.run.job import TrainJob
from coordinator.run.stores import open_checked_store, resolve_durable_ref, resolve_store_ref
from core.errors import ZooidError, ZooidValueError
from engine.datasets import (DatasetManifest, DatasetSplit, ShardSource, load_dataset, publish_dataset,
                             validate_dataset)
from engine.objective import target_classes
from engine.shards import read_dataset_manifest
from engine.text_data import TextSettings, bpe_vocab, is_text


def text_settings(job: TrainJob) -> TextSettings:
    """The job's `tokenizer`, `objective` and `seq_len`."""
    return TextSettings(tokenizer=job.tokenizer, objective=job.objective, seq_len=job.seq_len)


def _tokenizer_cache(job: TrainJob, durable_ref: str | None) -> Store | None:
    """The durable store, opened, when the job trains a BPE tokenizer; None otherwise or when it
    cannot be opened (the store check names it; the tokenizer is then trained uncached)."""
    if not durable_ref or not is_text(job.dataset) or bpe_vocab(job.tokenizer) is None:
        return None
    try:
        return open_store_ref(durable_ref)
    except Exception:  # any failure to open it (a block, a client library) is the store check's to name
        return None


def load_job_dataset(job: TrainJob, durable_ref: str | None = None) -> DatasetSplit:
    """The job's dataset in memory (`engine.datasets.load_dataset`), a BPE tokenizer read from
    or written to the durable store `durable_ref` (None: trained in this process only)."""
    cache = _tokenizer_cache(job, durable_ref)
    try:
        return load_dataset(job.dataset, text_settings(job), cache=cache, open_source=open_store_ref)
    finally:
        if cache is not None:
            cache.close()


@dataclass(frozen=True)
class JobSample:
    """The job's dataset as validation checks it (`job_sample`)."""

    data: DatasetSplit
    """All of it, or a prepared dataset's first training and validation shards."""
    n_train: int
    n_val: int
    classes: int
    """Labels, or for token targets the vocabulary they use (`engine.objective.target_classes`)."""
    manifest: DatasetManifest | None = None
    """A prepared dataset's; None for a dataset loaded here."""

    @property
    def objective(self) -> str | None:
        """The objective a prepared text dataset was prepared with; None: the job's."""
        return self.manifest.text.objective if self.manifest is not None and self.manifest.text else None

    @property
    def shard_rows(self) -> int:
        """Rows per shard of a prepared dataset; 0: the run stages the dataset."""
        return self.manifest.subset_size if self.manifest is not None else 0


def job_sample(job: TrainJob) -> JobSample:
    """The job's dataset for validation: a prepared dataset's manifest and first shards
    (`prepared_sample`: never loaded whole), else the dataset checked by name
    (`engine.datasets.validate_dataset`, with the job's text settings) and loaded whole, a BPE
    tokenizer read from or kept in the job's durable store. One line naming the field."""
    if is_prepared(job.dataset):
        manifest, data = prepared_sample(job.dataset)
        return JobSample(data, manifest.n_train, manifest.n_val, manifest.classes, manifest)
    validate_dataset(job.dataset, text_settings(job))
    data = load_job_dataset(job, resolve_durable_ref(job.durable_store, resolve_store_ref(job.store)))
    return JobSample(data, len(data.train_y), len(data.val_y), target_classes(data.train_y, data.val_y))


def publish_job_dataset(store: Store, run_id: str, job: TrainJob, subset_size: int) -> DatasetManifest:
    """Publish the job's dataset to the durable `store` (`engine.datasets.publish_dataset`)."""
    return publish_dataset(store, run_id, job.dataset, subset_size, text=text_settings(job),
                           open_source=open_store_ref)


PREPARED = ("file://", "s3://", "az://", BLOCK_PREFIX)
"""How a prepared dataset is named: its store's URL, or a store block."""


def is_prepared(dataset: str) -> bool:
    """Whether `dataset` names a prepared dataset (a store URL or block) rather than a source."""
    return dataset.startswith(PREPARED)


def read_prepared_manifest(dataset: str) -> DatasetManifest:
    """The manifest of the prepared dataset `dataset`; one line naming `dataset` when its store
    cannot be opened or holds no manifest of this format."""
    store = open_checked_store(dataset, "dataset")
    try:
        return read_dataset_manifest(store, "")
    finally:
        store.close()


def prepared_sample(dataset: str) -> tuple[DatasetManifest, DatasetSplit]:
    """The manifest of the prepared dataset `dataset` and a sample of it for the model checks:
    its first training and validation shards (checked against their checksums), carrying the
    manifest's text settings and id bound."""
    store = open_checked_store(dataset, "dataset")
    try:
        source = ShardSource(store, "")
        manifest = source.manifest
        x, y = source.read([0])
        vx, vy = source.read([0], split="val") if manifest.n_val_subsets else (x[:0], y[:0])
    except ZooidValueError:
        raise
    except ZooidError as exc:  # a shard that stayed missing or corrupt
        raise ZooidValueError("dataset", str(exc)) from None
    finally:
        store.close()
    return manifest, DatasetSplit(x, y, vx, vy, manifest.text, id_bound=manifest.id_bound)

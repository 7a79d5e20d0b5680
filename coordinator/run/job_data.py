"""The job's dataset as the coordinator loads and stages it.

A `text:` dataset needs more than its name: the job's `tokenizer`, `objective` and `seq_len`
(`engine.text_data.TextSettings`), the durable store that keeps trained tokenizers, and, for a
corpus in a store block, the block's opener (`blocks.store_refs.open_store_ref`: the worker side
never loads Prefect blocks, so the coordinator reads the corpus and publishes it tokenized).
Validation (`coordinator.run.validate`) and staging (`coordinator.workers.staging`) both load it here.
"""
from __future__ import annotations

from blocks.store_refs import open_store_ref
from comm.store import Store
from coordinator.run.job import TrainJob
from engine.datasets import DatasetManifest, DatasetSplit, load_dataset, publish_dataset
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


def publish_job_dataset(store: Store, run_id: str, job: TrainJob, subset_size: int) -> DatasetManifest:
    """Publish the job's dataset to the durable `store` (`engine.datasets.publish_dataset`)."""
    return publish_dataset(store, run_id, job.dataset, subset_size, text=text_settings(job),
                           open_source=open_store_ref)

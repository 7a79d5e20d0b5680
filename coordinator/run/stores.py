"""The run's two store references, from the job's `store` and `durable_store`.

Validation resolves them for the `ResolvedJob` (`coordinator.run.validate.check_stores`), and
loading the dataset for validation needs the durable one, which keeps trained tokenizers
(`coordinator.run.job_data.job_sample`).
"""
from __future__ import annotations

from blocks.store_block import block_ref
from blocks.store_refs import is_store_url
from comm.store_dir import default_store_url, path_from_url


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

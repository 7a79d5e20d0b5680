"""The run's two store references, from the job's `store` and `durable_store`, and the one
opener that checks a store reference before anything is rented (`open_checked_store`).

Validation resolves them for the `ResolvedJob` (`coordinator.run.validate.check_stores`), and
loading the dataset for validation needs the durable one, which keeps trained tokenizers
(`coordinator.run.job_data.job_sample`); a prepared dataset's store is opened the same way.
"""
from __future__ import annotations

from blocks.store_block import BLOCK_PREFIX, block_ref
from blocks.store_refs import is_store_url, load_store_block, open_store_ref
from comm.store_dir import default_store_url, path_from_url
from core.errors import StoreError, ZooidValueError


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


def open_checked_store(store_ref: str, field: str = "store"):
    """Open the store and ping it; unreachable or unknown -> ZooidValueError naming `field`
    (`store`, `durable_store`, or `dataset` for a prepared dataset's store)."""
    try:
        if store_ref.startswith(BLOCK_PREFIX):
            try:
                load_store_block(store_ref)
            except Exception as exc:
                raise ZooidValueError(field, f"no store block named {store_ref[len(BLOCK_PREFIX):]!r} "
                                      f"and not a URL (file://, redis://, s3://, az://): {type(exc).__name__}") from None
        store = open_store_ref(store_ref)
        store.ping()
    except ZooidValueError as exc:
        if exc.field != "store" or field == "store":
            raise  # (a URL parameter's error keeps its own name)
        raise ZooidValueError(field, str(exc).removeprefix("store: ")) from None
    except (StoreError, OSError, ValueError) as exc:
        raise ZooidValueError(field, f"cannot reach {store_ref.split('@')[-1]}: {exc}") from None
    return store

"""The store interface: bytes under keys, all of them below `runs/<run_id>/`.

Three implementations live beside this module (`store_dir`, `store_redis`, `store_s3`);
`open_store(url)` picks one from a URL:

- `file:///abs/path` or a plain path: a directory (the embedded default, `.zooid/store`)
- `redis://host:port/db`: Redis
- `s3://bucket/prefix` (endpoint from `AWS_ENDPOINT_URL` / `ZOOID_S3_ENDPOINT`): S3

A reader never sees half an object: every `put` is atomic. Values are raw bytes; tensors
are encoded by `training.tensor_codec` (safetensors), never pickled.
"""
from __future__ import annotations

import abc


class Store(abc.ABC):
    """Bytes under string keys with atomic puts and a blocking get."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key` atomically (readers see all of it or nothing)."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the bytes under `key`; wait up to `timeout` seconds for it to appear
        (None: do not wait). Raises `StoreTimeout` (or KeyError when not waiting)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether `key` is present."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`, sorted."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix`; return how many were deleted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete one key (no error when absent)."""

    def ping(self) -> None:
        """Raise `StoreError` when the store cannot be reached (checked before a run)."""

    def close(self) -> None:
        """Release connections."""


def open_store(url: str) -> Store:
    """Open the store a URL names (see the module docstring)."""
    raise NotImplementedError("filled in by the stores work")

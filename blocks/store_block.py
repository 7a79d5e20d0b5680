"""`StoreBlock`: the one base of every Zooid store block, and the one reference to a saved one.

A store block says where a run's store is and holds its secrets, so a job names the block
and no secret travels as a flow parameter, a job variable, a log line or an artifact. Every
store block (`blocks.store_refs.ZooidStore`, `blocks.cloud.ZooidS3Store`,
`blocks.cloud.ZooidRedisStore`) has the same interface:

- `url()`: where the store is, with no secret in it (safe to log);
- `open()`: a store client in this process, its credentials handed over as arguments, never
  through `os.environ`;
- `worker_environment()`: what a worker needs in its environment, never a secret;
- `ref()`: what a worker receives, `block:<type slug>/<name>`; the worker opens it with
  `blocks.store_refs.open_store_ref`, which loads the block itself from the Prefect API.

The reference is `block:<type slug>/<name>`; the older `block:<name>` still means a
`zooid-store` block of that name (`parse_block_ref`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from prefect.blocks.core import Block

from core.errors import ZooidValueError

BLOCK_PREFIX = "block:"
"""What starts every store block reference."""
DEFAULT_BLOCK_TYPE = "zooid-store"
"""The type slug of `ZooidStore`, which a reference without a slug (`block:<name>`) names."""


class StoreBlock(Block, ABC):
    """Base of the store blocks (module docstring); abstract, so Prefect registers only its
    subclasses as block types."""

    @abstractmethod
    def url(self) -> str:
        """Where the store is, without any secret (safe to log)."""

    @abstractmethod
    def open(self):
        """Open the store in this process (a `comm.store_base.Store`); credentials reach the
        client as arguments, never through the process environment."""

    def worker_environment(self) -> dict[str, str]:
        """Environment variables a worker of this store needs; never a secret. None here."""
        return {}

    def ref(self) -> str:
        """What a worker receives for this saved block: `block:<type slug>/<name>`."""
        name = getattr(self, "_block_document_name", None)
        if not name:
            raise ZooidValueError("store", "save the block before handing it to workers (it has no name)")
        return block_ref(f"{self.get_block_type_slug()}/{name}")


def block_ref(name: str) -> str:
    """The reference for a store block named `<name>`, `<type slug>/<name>`, `block:<name>` or
    `block:<type slug>/<name>`: always `block:<type slug>/<name>` (no slug: `zooid-store`)."""
    slug, block_name = parse_block_ref(name if name.startswith(BLOCK_PREFIX) else BLOCK_PREFIX + name)
    return f"{BLOCK_PREFIX}{slug}/{block_name}"


def parse_block_ref(ref: str) -> tuple[str, str]:
    """(type slug, block name) of `block:<type slug>/<name>`, or of the older `block:<name>`
    (a `zooid-store` block); ZooidValueError("store") for anything else."""
    if not ref.startswith(BLOCK_PREFIX):
        raise ZooidValueError("store", f"expected block:<type slug>/<name>, got {ref!r}")
    slug, _, name = ref[len(BLOCK_PREFIX):].rpartition("/")
    if not name or "/" in slug:
        raise ZooidValueError("store", f"expected block:<type slug>/<name>, got {ref!r}")
    return slug or DEFAULT_BLOCK_TYPE, name

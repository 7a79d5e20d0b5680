"""A store's requests by kind, with the bytes they moved (`StoreOps`): what a store client
counted (`comm.store_base.Store.ops`), what a worker reports for an epoch
(`core.specs.WorkerResult.store_ops`), what an epoch and a run add up to, and what the bill
prices (`planners.store_prices`).

The kinds are the requests a store's offer bills apart:

- `put`: a write (S3 PutObject, UploadPart and the multipart calls around them; Azure Put
  Blob, Put Block, Put Block List; a file written; a Redis SET);
- `get`: a read that found its key (S3 GetObject; Azure Get Blob, one per range);
- `miss`: a read that found nothing: each poll of a get that waits for a peer's key is one
  (billed as a GET; how many depends on timing, so a count derived from a protocol leaves
  them out);
- `head`: whether a key is there (S3 HeadObject; Azure Get Blob Properties);
- `list`: one page of keys (S3 ListObjectsV2, 1,000 keys a page; Azure List Blobs, 5,000);
- `delete`: one delete request (S3 DeleteObject, a DeleteObjects batch of up to 1,000; Azure
  Delete Blob, a Blob Batch of up to 256).

`bytes_in` are the bytes written to the store, `bytes_out` the bytes read from it.

Counts of several stores travel grouped by where they went (`{store: StoreOps}`, the store
named as `comm.store_base.Store.where` names it: `s3://bucket`, `redis://host:port`, `file://`),
since each store is billed by its own offer; `grouped_total` adds groups, `grouped_json` writes one.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

REQUEST_KINDS = ("put", "get", "miss", "head", "list", "delete")
"""The request kinds, in the order a bill lists them."""


@dataclass(frozen=True)
class StoreOps:
    """Requests by kind and bytes each way; adds and subtracts field by field."""

    put: int = 0
    get: int = 0
    miss: int = 0
    head: int = 0
    list: int = 0
    delete: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def requests(self) -> int:
        """Every request, of any kind."""
        return sum(getattr(self, k) for k in REQUEST_KINDS)

    def __add__(self, other: "StoreOps") -> "StoreOps":
        return StoreOps(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "StoreOps") -> "StoreOps":
        return StoreOps(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict:
        """The JSON form: every field, zeros included."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict | None) -> "StoreOps":
        """From `to_dict`'s form; missing fields are 0, unknown ones dropped (None: empty)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in (d or {}).items() if k in names})


def total(items) -> StoreOps:
    """The sum of `StoreOps` or their dicts."""
    out = StoreOps()
    for item in items:
        out = out + (item if isinstance(item, StoreOps) else StoreOps.from_dict(item))
    return out


def grouped_total(groups) -> dict[str, StoreOps]:
    """The sum of groups of counts by store (`{store: StoreOps or its dict}` each)."""
    out: dict[str, StoreOps] = {}
    for group in groups:
        for where, ops in (group or {}).items():
            out[where] = out.get(where, StoreOps()) + (ops if isinstance(ops, StoreOps) else StoreOps.from_dict(ops))
    return out


def grouped_json(groups: dict[str, StoreOps]) -> dict[str, dict]:
    """A group of counts by store in JSON form (stores with no count left out)."""
    return {where: ops.to_dict() for where, ops in sorted(groups.items()) if ops}

"""What a run's store costs (issue #45): the store's offer, from its URL and the compute
provider, and the price of its request counts (`core.store_ops.StoreOps`) and servers under it.

- S3 Standard bills PUT, COPY, POST and LIST at one price and GET, HEAD and the rest at another;
  DELETE is free.
- Azure Blob, hot tier, bills per 10,000 operations by class: write (Put Blob, Put Block, Put
  Block List), read (Get Blob), list, and all other (Get Blob Properties); Delete is free.
- A Redis the cloud runs (any host but this machine) is one node of the provider's smallest
  managed Redis (ElastiCache; Azure Cache for Redis) for the run's length; requests are free.
- A directory, or a Redis on this machine, costs nothing.

Prices come from the catalog (`planners.catalog`, `prices.json`: each row with its source and
date). Pure: the bill (`coordinator.bill.cost.store_records`) and the prediction call it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from core.formats import money
from core.object_requests import object_requests
from core.store_ops import REQUEST_KINDS, StoreOps
from planners.catalog import request_price, store_node_price

LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "::1")
"""Hosts of a Redis on this machine (free: no node is rented for it)."""

VERBS = {"put": "PUT", "get": "GET", "miss": "missed GET", "head": "HEAD", "list": "LIST", "delete": "DELETE"}
"""How a bill line names each request kind."""


@dataclass(frozen=True)
class StoreOffer:
    """How one store is billed: request prices by kind (a kind absent is free) and a node."""

    name: str
    """`s3-standard`, `azure-blob-hot`, the Redis node's catalog name, or `free`."""
    label: str
    """What a bill line calls the store: `S3`, `Azure Blob`, `Redis`, `directory`."""
    classes: dict = field(default_factory=dict)
    """Request kind -> the catalog's request price name (`s3-put`, `az-blob-hot-read`, ...)."""
    node_per_hour: float = 0.0
    """Dollars per hour of the store's server (a cloud Redis), 0 when it has none."""
    objects: str = ""
    """How it splits a large object into requests (`core.object_requests`: `s3`, `azure`; empty: one)."""

    def object_requests(self, nbytes: float) -> tuple[int, int]:
        """(put, get) requests of one object of `nbytes` bytes on this store."""
        return object_requests(self.objects, int(nbytes))

    def prices(self) -> dict[str, float]:
        """Dollars of one request by kind (kinds absent are free): what the planner weighs
        (`planners.strategy.StrategyInputs.store_request_usd`)."""
        return {kind: request_price(name) for kind, name in self.classes.items()}

    def request_usd(self, ops: StoreOps) -> float:
        """Dollars of the requests `ops` counts."""
        return sum(getattr(ops, kind) * request_price(name) for kind, name in self.classes.items())

    def node_usd(self, seconds: float) -> float:
        """Dollars of the store's server for `seconds`."""
        return self.node_per_hour * max(0.0, seconds) / 3600.0

    def usd(self, ops: StoreOps, seconds: float) -> float:
        """The store's whole bill: its requests and its server for `seconds`."""
        return self.request_usd(ops) + self.node_usd(seconds)

    def charges(self, ops: StoreOps) -> list[dict]:
        """One line per priced class: its catalog name, the kinds it covers, how many requests,
        the price of one and the dollars (classes with no requests left out)."""
        lines: dict[str, dict] = {}
        for kind in REQUEST_KINDS:
            name = self.classes.get(kind)
            if name is None or not getattr(ops, kind):
                continue
            line = lines.setdefault(name, {"name": name, "kinds": [], "requests": 0,
                                           "unit_price": request_price(name)})
            line["kinds"].append(VERBS[kind])
            line["requests"] += getattr(ops, kind)
        for line in lines.values():
            line["usd"] = line["requests"] * line["unit_price"]
        return list(lines.values())


S3_STANDARD = StoreOffer("s3-standard", "S3", {
    "put": "s3-put", "list": "s3-put", "get": "s3-get", "miss": "s3-get", "head": "s3-get"}, objects="s3")
AZURE_BLOB_HOT = StoreOffer("azure-blob-hot", "Azure Blob", {
    "put": "az-blob-hot-write", "get": "az-blob-hot-read", "miss": "az-blob-hot-read", "list": "az-blob-hot-list",
    "head": "az-blob-hot-other"}, objects="azure")


def store_offer(url: str, provider: str | None = None) -> StoreOffer:
    """The offer a store URL is billed by; `provider` (the compute offer's, `aws` or `azure`)
    picks the managed Redis of a Redis that is not on this machine."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        return S3_STANDARD
    if scheme == "az":
        return AZURE_BLOB_HOT
    if scheme in ("redis", "rediss", "unix"):
        if scheme == "unix" or (parts.hostname or "") in LOCAL_HOSTS:
            return StoreOffer("free", "Redis (this machine)")
        name, per_hour = store_node_price(provider or "aws")
        return StoreOffer(name, "Redis", node_per_hour=per_hour)
    return StoreOffer("free", "directory")


def bill_line(offer: StoreOffer, ops: StoreOps, usd: float) -> str:
    """`S3: 48,120 PUT, 96,240 GET, 1.9 GB in, 2.1 GB out, $0.26`: the requests by kind (kinds
    with none left out), the bytes each way and the dollars."""
    parts = [requests_words(ops) or "no requests", f"{_gb(ops.bytes_in)} in", f"{_gb(ops.bytes_out)} out"]
    return f"{offer.label}: {', '.join(parts)}, {money(usd)}"


def requests_words(ops: StoreOps) -> str:
    """`48,120 PUT, 96,240 GET`: the requests by kind, kinds with none left out."""
    return ", ".join(f"{getattr(ops, k):,} {VERBS[k]}" for k in REQUEST_KINDS if getattr(ops, k))


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"

"""The price catalog: offers (containers, functions, VMs) and their per-second prices.

Data lives in `prices.json` beside this module, each entry with its source and date.
An offer is billed either per resource (vCPU-s, GB-s, GPU-s: containers), per GB-s
(functions) or per instance-hour (VMs); `price_per_s` turns any of them into dollars per
second for a worker of a given size. A spot offer (`SpotOffer`, `spot_offer`) shadows an
on-demand one at a discount, with the notice it gives before it takes the worker back and an
interruption rate, assumed until a run measures it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

_CATALOG = Path(__file__).with_name("prices.json")


@dataclass(frozen=True, kw_only=True)
class Offer:
    """One rentable kind of worker."""

    name: str
    provider: str
    kind: str
    """`container`, `function` or `vm`."""
    vcpu: float
    memory_gb: float
    gpu: int = 0
    gpu_type: str | None = None
    unit_prices: dict = field(default_factory=dict)
    network_bytes_per_s: float = 0.0
    source: str = ""
    date: str = ""

    def price_per_s(self, vcpu: float | None = None, memory_gb: float | None = None,
                    gpu: int | None = None) -> float:
        """Dollars per second for one worker; containers and functions are billed for the
        size asked (defaults: the offer's own size), VMs per whole instance."""
        v = self.vcpu if vcpu is None else vcpu
        m = self.memory_gb if memory_gb is None else memory_gb
        g = self.gpu if gpu is None else gpu
        p = self.unit_prices
        if "instance_hour" in p:
            return p["instance_hour"] / 3600.0
        if "gb_second" in p:
            return p["gb_second"] * m
        return (v * p.get("vcpu_hour", 0.0) + m * p.get("gb_hour", 0.0)
                + g * p.get("gpu_hour", 0.0)) / 3600.0

    def price_per_hour(self, **size) -> float:
        """Dollars per hour for one worker (see `price_per_s`)."""
        return self.price_per_s(**size) * 3600.0


@lru_cache(maxsize=1)
def _load() -> dict:
    return json.loads(_CATALOG.read_text())


def offers() -> dict[str, Offer]:
    """Every offer in the catalog by name."""
    fields = Offer.__dataclass_fields__
    return {o["name"]: Offer(**{k: v for k, v in o.items() if k in fields}) for o in _load()["offers"]}


def get_offer(name: str) -> Offer:
    """The offer called `name`; ValueError naming the valid ones otherwise."""
    all_offers = offers()
    if name not in all_offers:
        raise ValueError(f"offer: unknown offer {name!r}; valid: {', '.join(sorted(all_offers))}")
    return all_offers[name]


@dataclass(frozen=True, kw_only=True)
class SpotOffer:
    """Spare capacity sold at a discount below the on-demand offer it shadows, taken back
    after a notice (`prices.json` `spot`): its price, the notice, the interruption rate."""

    name: str
    shadows: str
    """The on-demand offer it is a discount of (`fargate-cpu`, `aci-cpu`)."""
    provider: str
    kinds: tuple[str, ...]
    """The target kinds (`core.kinds.TargetKind`) whose templates can ask for it."""
    unit_prices: dict = field(default_factory=dict)
    """Its own list prices where the catalog has them; empty: the shadowed offer's less `discount`."""
    discount: float = 0.0
    """The fraction below the shadowed offer's price (where `unit_prices` is empty)."""
    notice_s: float = 0.0
    """Seconds between the notice (SIGTERM) and the stop (SIGKILL)."""
    interruptions_per_worker_hour: float = 0.0
    """Interruptions of one worker per hour, until a run on the target measures it."""
    assumed: bool = True
    """The rate is assumed (no run measured it)."""
    source: str = ""
    rate_source: str = ""
    date: str = ""

    def offer(self) -> Offer:
        """The spot capacity as an `Offer` of the shadowed one's size, billed at the spot price."""
        base = get_offer(self.shadows)
        prices = dict(self.unit_prices) or {k: v * (1.0 - self.discount) for k, v in base.unit_prices.items()}
        return Offer(name=self.name, provider=base.provider, kind=base.kind, vcpu=base.vcpu,
                     memory_gb=base.memory_gb, gpu=base.gpu, gpu_type=base.gpu_type, unit_prices=prices,
                     network_bytes_per_s=base.network_bytes_per_s, source=self.source, date=self.date)

    def price_per_s(self, vcpu: float | None = None, memory_gb: float | None = None, gpu: int | None = None) -> float:
        """Dollars per second for one spot worker (`Offer.price_per_s`)."""
        return self.offer().price_per_s(vcpu, memory_gb, gpu)


def spot_offers() -> dict[str, SpotOffer]:
    """Every spot offer in the catalog by name."""
    fields = SpotOffer.__dataclass_fields__
    return {o["name"]: SpotOffer(**{k: (tuple(v) if k == "kinds" else v) for k, v in o.items() if k in fields})
            for o in _load()["spot"]}


def spot_offer(offer_name: str, kind: str) -> SpotOffer | None:
    """The spot offer that shadows on-demand offer `offer_name` on a target of `kind`; None
    where the target has none (inline, the process pool, a GPU or VM offer)."""
    return next((s for s in spot_offers().values() if s.shadows == offer_name and str(kind) in s.kinds), None)


def request_price(name: str) -> float:
    """Dollars per request (e.g. `s3-put`, `s3-get`)."""
    for r in _load()["requests"]:
        if r["name"] == name:
            return float(r["price_per_request"])
    raise ValueError(f"request: unknown request price {name!r}")


def store_node_price(provider: str) -> tuple[str, float]:
    """The smallest managed Redis node of `provider` (`aws`: ElastiCache, `azure`: Azure Cache
    for Redis) as (name, dollars per hour); ValueError naming the providers it knows otherwise."""
    rows = {r["provider"]: r for r in _load()["store_nodes"]}
    if provider not in rows:
        raise ValueError(f"provider: no Redis node price for {provider!r}; the catalog has {', '.join(sorted(rows))}")
    return rows[provider]["name"], float(rows[provider]["price_per_hour"])


def device_figures(gpu_type: str | None, vcpu: float) -> dict:
    """What one worker's device is assumed to do per second (a plan with no profile to go on,
    `profiling.estimate`): the catalog's figures for `gpu_type`, else for a CPU of `vcpu`
    vCPUs (rates per vCPU times `vcpu`). ValueError naming the GPU types it knows otherwise."""
    rows = {d["name"]: d for d in _load()["devices"]}
    name = gpu_type or "cpu"
    if name not in rows:
        known = ", ".join(sorted(n for n in rows if n != "cpu"))
        raise ValueError(f"gpu_type: no figures for {name!r} in the catalog; it has {known}")
    row = dict(rows[name])
    if row.pop("per") == "vcpu":
        row["flops_per_s"] *= max(vcpu, 1.0)
        row["bytes_per_s"] *= max(vcpu, 1.0)
    return row


def store_figures(scheme: str, network_bytes_per_s: float = 0.0) -> dict:
    """A store's assumed bandwidth and latency by URL scheme (`file`, `redis`, `s3`, `az`), the
    bandwidth no more than the worker's network (`network_bytes_per_s`, 0: unbounded)."""
    rows = {s["scheme"]: s for s in _load()["stores"]}
    row = dict(rows.get({"rediss": "redis"}.get(scheme, scheme)) or rows["s3"])
    if network_bytes_per_s:
        row["bandwidth_bytes_per_s"] = min(row["bandwidth_bytes_per_s"], network_bytes_per_s)
    return row

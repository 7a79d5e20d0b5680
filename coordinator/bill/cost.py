"""The cost ledger: one row per resource interval, priced from the catalog.

Cost comes from measured intervals (a worker's launch to its exit, failed and cancelled
attempts included, and the coordinator's whole run) times the offer's unit price, and from
the store's requests as the workers and the coordinator counted them, priced by the store's
offer (`store_records`).
The ledger lives at `runs/<run_id>/cost.json` and is rewritten after every epoch, so a run
that dies still leaves a bill up to its last epoch. The run's last write (`final`) comes
before its report is rendered, and nothing rewrites it: the report and cost.json agree.
"""
from __future__ import annotations

import json
from typing import Callable, Iterable

from core.cost_record import CostRecord
from core.keys import ledger_key
from core.store_ops import total
from planners.catalog import Offer
from planners.store_prices import bill_line, store_offer


def worker_records(run_id: str, epoch: int, outcomes: Iterable[dict], offer: Offer,
                   price_of: Callable[[int], float]) -> list[CostRecord]:
    """Ledger rows for one epoch's worker attempts (dicts of `WorkerOutcome.to_dict()`), each
    priced by its rank (`coordinator.run.context.RunContext.price_of`: per-stage sizes)."""
    rows = []
    for o in outcomes:
        stop = o.get("stopped_at") or o["started_at"]
        kind = "worker" if o["status"] == "completed" else "failed_attempt"
        failure = (o.get("extra") or {}).get("failure")
        status = o["status"] if not failure else f"{o['status']}:{failure['kind']}"
        rows.append(CostRecord(run_id=run_id, resource=f"worker e{epoch} r{o['rank']} a{o['attempt']}",
                               kind=kind, offer=offer.name, start=o["started_at"], stop=stop,
                               unit_price_per_s=price_of(o["rank"]), status=status, epoch=epoch,
                               rank=o["rank"], attempt=o["attempt"]))
    return rows


def coordinator_record(run_id: str, start: float, stop: float, offer: Offer,
                       price_per_s: float) -> CostRecord:
    """The coordinator's own interval, billed at its own size (`core.coordinator_size`), on-demand."""
    return CostRecord(run_id=run_id, resource="coordinator", kind="coordinator", offer=offer.name,
                      start=start, stop=stop, unit_price_per_s=price_per_s)


def store_records(run_id: str, parties: dict[str, dict], start: float, stop: float,
                  provider: str | None) -> list[CostRecord]:
    """Ledger rows of the run's stores: for each store and party (`workers`, `coordinator`:
    `{party: {Store.where: StoreOps}}`) its requests priced by the store's offer
    (`planners.store_prices`: S3, Azure Blob; free for a directory or a local Redis), and for
    a store on a rented server (a cloud Redis) its node from `start` to `stop`."""
    rows = []
    for where in sorted(set().union(*(groups.keys() for groups in parties.values()))):
        offer = store_offer(where, provider)
        for party, groups in parties.items():
            ops = groups.get(where)
            if ops:
                rows.append(CostRecord(run_id=run_id, resource=f"store {where} {party}", kind="store",
                                       offer=offer.name, start=start, stop=stop, unit_price_per_s=0.0,
                                       status=party, fixed_usd=offer.request_usd(ops), store_ops=ops.to_dict()))
        if offer.node_per_hour:
            rows.append(CostRecord(run_id=run_id, resource=f"store {where} node", kind="store", offer=offer.name,
                                   start=start, stop=stop, unit_price_per_s=offer.node_per_hour / 3600.0,
                                   status="node"))
    return rows


def store_lines(rows: Iterable[dict]) -> list[str]:
    """One line per store of a ledger (row dicts): `S3: 48,120 PUT, 96,240 GET, 1.9 GB in,
    0.4 GB out, $0.26`, its parties' requests and its node together."""
    by_where: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("kind") == "store":
            by_where.setdefault(r["resource"].split(" ")[1], []).append(r)
    return [bill_line(store_offer(where), total(r.get("store_ops") or {} for r in group),
                      sum(r.get("usd", 0.0) for r in group)) for where, group in sorted(by_where.items())]


def worker_seconds(rows: Iterable[dict]) -> dict[str, float]:
    """Worker-seconds of a ledger (row dicts) by what they paid for: `startup`, `busy` and
    `idle` and `profile` (warm workers), `cold` (a cold worker's whole attempt), `failed`
    (failed attempts)."""
    out = {"startup": 0.0, "busy": 0.0, "idle": 0.0, "profile": 0.0, "cold": 0.0, "failed": 0.0}
    for r in rows:
        if r["kind"] == "failed_attempt":
            out["failed"] += r["seconds"]
        elif r["kind"] == "worker":
            out[r["status"] if r["status"] in ("startup", "busy", "idle", "profile") else "cold"] += r["seconds"]
    return out


def spot_tally(rows: Iterable[dict]) -> dict:
    """What spot capacity did in a ledger (row dicts): `preemptions` (worker attempts the provider
    took back), `redone_s` (seconds of training replacements repeated), `spot_worker_s` (worker
    seconds billed on spot), `interruptions_per_worker_hour` (preemptions per spot worker-hour;
    None without spot seconds) and `saved_usd`: the on-demand price of every billed worker
    second (`list_price_per_s`) less what was billed, the redone work included."""
    preempted, redone, spot_s, saved = set(), 0.0, 0.0, 0.0
    for r in rows:
        if r.get("kind") not in ("worker", "failed_attempt"):
            continue
        if r.get("status") == "preempted":
            preempted.add((r.get("resource"), r.get("epoch"), r.get("rank"), r.get("attempt")))
        redone += float(r.get("redone_s") or 0.0)
        if r.get("capacity") == "spot":
            spot_s += r["seconds"]
        if r.get("list_price_per_s"):
            saved += r["seconds"] * r["list_price_per_s"] - (r["usd"] - float(r.get("fixed_usd") or 0.0))
    return {"preemptions": len(preempted), "redone_s": redone, "spot_worker_s": spot_s, "saved_usd": round(saved, 9),
            "interruptions_per_worker_hour": len(preempted) / (spot_s / 3600.0) if spot_s else None}


def spot_line(tally: dict) -> str | None:
    """`3 preemptions, 41 s of work redone, $0.0021 saved against on-demand` (None when the run
    rented no spot capacity and nothing was preempted)."""
    if not tally or not (tally.get("spot_worker_s") or tally.get("preemptions")):
        return None
    n = int(tally.get("preemptions") or 0)
    return (f"{n} preemption{'' if n == 1 else 's'}, {tally.get('redone_s') or 0.0:.0f} s of work redone, "
            f"${tally.get('saved_usd') or 0.0:.4f} saved against on-demand")


def total_usd(rows: Iterable[CostRecord]) -> float:
    """Dollars of every row."""
    return sum(r.usd for r in rows)


def write_ledger(store, run_id: str, rows: list[CostRecord], final: bool = False) -> str:
    """Write the ledger (rows and total) atomically; return its key. `final`: the run's last
    bill, the one its report shows; nothing rewrites a final ledger (`is_final`)."""
    doc = {"run_id": run_id, "currency": "USD", "total_usd": total_usd(rows), "final": final,
           "rows": [r.to_dict() for r in rows]}
    key = ledger_key(run_id)
    store.put(key, json.dumps(doc, indent=1).encode())
    return key


def is_final(doc: dict | None) -> bool:
    """Whether a ledger document is a run's last bill (written by `record_cost` before its
    report): a failure or cancellation hook that runs afterwards leaves it as it is."""
    return bool(doc and doc.get("final"))


def read_ledger(store, run_id: str) -> dict:
    """The ledger a run wrote."""
    return json.loads(store.get(ledger_key(run_id)))

"""The run's own store requests: what a run asks of its stores beyond its epochs' protocol
(`planners.store_requests.epoch_store_ops`) and warm channel (`warm_channel_ops`), measured on
one run and predicted for the next on the same target (issue #45).

Three parts, each counted by role (`store`: the run's store; `durable`: its durable store, where
that is another):

- `epoch`: what an epoch adds: the coordinator's bookkeeping (the epoch's checkpoint read, the
  history, the ledger, the leftovers of the epoch's prefixes listed and deleted), a worker's
  reads of its data and its wait for its next command;
- `staging`: from the plan to the first epoch sent: the dataset's manifest, the initial
  checkpoint, the run's document (the subsets' own requests, an existence check and a put each,
  are the run's dataset's: `staged_files`, taken out of a sample and added for the next run's);
- `teardown`: after the last epoch: the run's prefixes listed and deleted, the run terms, the
  final ledger, summary and curves.

A run measures them from snapshots of its requests (`coordinator.bill.ledger.store_ops_now`):
at the plan, at each epoch's send, and at its end. An epoch's sample is the requests between its
send and the next less what its protocol and warm channel predict; staging is everything from
the plan to the first send; teardown is what follows the last send less that epoch's prediction
and the epoch term. A worker's missed reads on the store its protocol runs over are left out:
they are its waits for its peers' keys, which depend on the plan's timing, not on the run
(`core.store_ops`: misses are the kind no protocol count holds).

Counts, not dollars, are kept: the next plan prices them by its own stores' offers.
"""
from __future__ import annotations

import dataclasses
import statistics

from core.store_ops import REQUEST_KINDS, StoreOps

PARTS = ("epoch", "staging", "teardown")

Parties = dict  # {party: {Store.where: StoreOps}}, as `coordinator.bill.ledger.store_ops_now` returns


def delta(after: Parties, before: Parties) -> Parties:
    """The requests made between two snapshots, by party and store."""
    out = {}
    for party, groups in after.items():
        earlier = before.get(party) or {}
        out[party] = {where: _ops(ops) - _ops(earlier.get(where)) for where, ops in groups.items()}
    return out


def by_role(parties: Parties, roles: dict[str, str], protocol_role: str | None) -> dict[str, StoreOps]:
    """`parties`' requests summed by the role of their store (`roles`: `{where: role}`; a store
    that is neither of the run's is left out), the workers' misses on `protocol_role` dropped."""
    out: dict[str, StoreOps] = {}
    for party, groups in parties.items():
        for where, ops in groups.items():
            role = roles.get(where)
            if role is None:
                continue
            ops = _ops(ops)
            if party == "workers" and role == protocol_role:
                ops = dataclasses.replace(ops, miss=0)
            out[role] = out.get(role, StoreOps()) + ops
    return out


def flat(parties: Parties) -> dict[str, StoreOps]:
    """Requests by party and role (a prediction's) summed by role."""
    out: dict[str, StoreOps] = {}
    for groups in parties.values():
        out = plus(out, {role: _ops(ops) for role, ops in groups.items()})
    return out


def minus(a: dict[str, StoreOps], b: dict[str, StoreOps]) -> dict[str, StoreOps]:
    """`a - b`, role by role (signed: a protocol may count more than a run made)."""
    return {role: a.get(role, StoreOps()) - b.get(role, StoreOps()) for role in set(a) | set(b)}


def plus(a: dict[str, StoreOps], b: dict[str, StoreOps]) -> dict[str, StoreOps]:
    """`a + b`, role by role."""
    return {role: a.get(role, StoreOps()) + b.get(role, StoreOps()) for role in set(a) | set(b)}


def to_json(ops: dict[str, StoreOps]) -> dict[str, dict]:
    """A part's counts by role in JSON form (request kinds only; bytes are not priced)."""
    return {role: {k: getattr(o, k) for k in REQUEST_KINDS} for role, o in sorted(ops.items())}


def median(samples: list[dict]) -> dict[str, dict]:
    """Each role's and kind's median over `samples` (`to_json`'s form), rounded to a request;
    a role a sample lacks counts as 0 there."""
    if not samples:
        return {}
    roles = sorted({role for s in samples for role in s})
    return {role: {k: round(statistics.median([(s.get(role) or {}).get(k, 0) for s in samples]))
                   for k in REQUEST_KINDS} for role in roles}


def staged_files(files: int, role: str) -> dict[str, StoreOps]:
    """The requests of staging `files` data subsets on the store of `role`
    (`coordinator.workers.staging`: whether each is there, then its put)."""
    return {role: StoreOps(put=files, head=files)} if files > 0 else {}


def samples(roles: dict[str, str], at_plan: Parties | None, epochs: list[tuple], at_end: Parties | None,
            staged: dict[str, StoreOps] | None = None) -> dict:
    """One run's samples of the three parts (`{part: [counts by role]}`), from the snapshots:
    `epochs` holds `(parties at its send, its predicted requests by party and role, its protocol's
    role)`, the prediction's workers' misses on the protocol's role dropped as the measured ones are,
    for each epoch the coordinator sent. An epoch's own requests are those between its send and
    the next less its prediction; the steady epochs (the second to the one before the last) are
    the `epoch` samples; what the first adds beyond their median (its workers' first reads of
    their data) goes to `staging` with the requests from the plan to its send, and what the last
    adds, with everything after, to `teardown`; `staged` (`staged_files`) is taken out of staging.
    Parts it cannot tell (no epoch, no end) are left out."""
    if not roles or at_plan is None or not epochs:
        return {}
    same = {role: role for role in roles.values()}

    def excess(after: Parties, epoch: tuple) -> dict[str, StoreOps]:
        return minus(by_role(delta(after, epoch[0]), roles, epoch[2]), by_role(epoch[1], same, epoch[2]))

    own = [excess(b[0], a) for a, b in zip(epochs, epochs[1:])]
    if at_end is not None:
        own.append(excess(at_end, epochs[-1]))
    steady = [to_json(o) for o in own[1:len(own) - (at_end is not None)]]  # the last's holds the teardown
    term = {role: StoreOps.from_dict(ops) for role, ops in median(steady).items()}
    staging = minus(by_role(delta(epochs[0][0], at_plan), roles, epochs[0][2]), staged or {})
    if own:
        staging = plus(staging, minus(own[0], term))  # the first epoch's excess
    out = {"staging": [to_json(staging)]}
    if steady:
        out["epoch"] = steady
    if at_end is not None and len(own) > 1:
        out["teardown"] = [to_json(minus(own[-1], term))]
    return out


def priced(counts: dict[str, dict], extra: dict[str, StoreOps], offers: dict) -> float:
    """Dollars of `counts` (a part's medians by role) plus `extra` (the protocol's requests by
    role), each role's kinds at least 0, priced by its offer (`offers`: `{role: StoreOffer}`;
    a role without one is free)."""
    usd = 0.0
    for role in set(counts) | set(extra):
        if role not in offers:
            continue
        ops = StoreOps.from_dict(counts.get(role)) + extra.get(role, StoreOps())
        usd += offers[role].request_usd(StoreOps(**{k: max(0, getattr(ops, k)) for k in REQUEST_KINDS}))
    return usd


def _ops(ops) -> StoreOps:
    return ops if isinstance(ops, StoreOps) else StoreOps.from_dict(ops)

"""Which store requests a worker's result reports (`core.specs.WorkerResult.store_ops`): each
client's requests since the last result reported them, so that a warm worker's clients, which
serve epoch after epoch, report their polling between two epochs with the next one, and every
request is reported once. `runtime.run_spec` reports the epoch's own clients; `also_report`
adds a client that no epoch sees (a warm worker's watch thread: lease reads, status posts)."""
from __future__ import annotations

import threading
import weakref
from typing import Iterable

from comm.store_base import Store
from core.store_ops import StoreOps, grouped_json, grouped_total

_REPORTED: "weakref.WeakKeyDictionary[Store, StoreOps]" = weakref.WeakKeyDictionary()
"""What each client's requests stood at when a result last reported them."""
_ALSO: "weakref.WeakSet[Store]" = weakref.WeakSet()
_LOCK = threading.Lock()


def also_report(store: Store) -> None:
    """Report `store`'s requests with every later epoch's result of this process."""
    with _LOCK:
        _ALSO.add(store)


def unreported(stores: Iterable[Store]) -> dict[str, dict]:
    """The requests of `stores` and of the clients `also_report` named, since each was last
    reported, by store (`{Store.where: StoreOps.to_dict()}`); from now on they count as reported."""
    with _LOCK:
        clients = list(dict.fromkeys([*stores, *_ALSO]))  # each once, in order
        groups = []
        for client in clients:
            now = client.ops
            groups.append({client.where: now - _REPORTED.get(client, StoreOps())})
            _REPORTED[client] = now
    return grouped_json(grouped_total(groups))

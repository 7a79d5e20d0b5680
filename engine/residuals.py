"""Where a replica's error-feedback residual (`comm.compression`) is kept between rounds,
epochs and lives, in the durable store beside the checkpoints; never pickled.

Within an epoch each rank writes its residual after round r, `residual_key(run, epoch,
rank, r)`, at every round the sync checkpoint is written (and at the epoch's last), *before*
it posts its reduced slice of round r: so when the sync checkpoint of round r exists, every
rank's residual of round r exists too, and a relaunched rank continues its own exactly
(`engine.local_sgd_epoch`). A rank keeps its last `KEPT` such keys (a relaunch reads round
c >= its current round - 2 checkpoint rounds) and, at the epoch's end, only the last.

The epoch checkpoint names the last round's keys of every rank (`residual_keys` in its
metadata); the next epoch's ranks continue from them through `comm.compression.residual_for`:
each its own when the world is unchanged, else each its slice of the update still owed.
"""
from __future__ import annotations

from comm.compression import Flat, residual_for
from comm.store import Store
from comm.tensor_codec import decode_tensors, encode_tensors
from core.keys import residual_key, residual_prefix

KEPT = 3


def save_residual(store: Store, key: str, residual: Flat) -> int:
    """Write a residual (`{dtype name: flat vector}`) in one put; return the bytes written."""
    blob = encode_tensors({d: v.detach() for d, v in residual.items()})
    store.put(key, blob)
    return len(blob)


def read_residual(store: Store, key: str) -> Flat:
    """A residual written by `save_residual`."""
    tensors, _ = decode_tensors(store.get(key))
    return tensors


def continue_residual(store: Store, keys: list[str], rank: int, world: int) -> Flat:
    """Rank `rank`'s starting residual in a group of `world` from the previous group's keys
    (one per rank; none: zeros, which is an empty residual)."""
    if not keys:
        return {}
    if len(keys) == world:
        return read_residual(store, keys[rank])
    return residual_for([read_residual(store, k) for k in keys], rank, world)


class ResidualWriter:
    """One rank's residual keys in one epoch: write, keep the last `KEPT`, prune at the end."""

    def __init__(self, store: Store, run_id: str, epoch: int, rank: int):
        self.store, self.run_id, self.epoch, self.rank = store, run_id, epoch, rank
        self.written: list[str] = []

    def write(self, round_: int, residual: Flat) -> None:
        key = residual_key(self.run_id, self.epoch, self.rank, round_)
        save_residual(self.store, key, residual)
        if key not in self.written:
            self.written.append(key)
        for old in self.written[:-KEPT]:
            self.store.delete(old)
        del self.written[:-KEPT]

    def finish(self, last_round: int) -> None:
        """Delete every residual of this rank and epoch but the last round's (a previous
        life's included)."""
        keep = residual_key(self.run_id, self.epoch, self.rank, last_round)
        for key in self.store.list(residual_prefix(self.run_id, self.epoch, self.rank)):
            if key != keep:
                self.store.delete(key)

"""The order of an epoch's training samples, and each replica's batches of it.

Elastic determinism: which samples an epoch trains, and in what order, is a function of the
seed, the epoch and the dataset's shards alone, never of how many workers read them. The
worker count may change between epochs, or in the middle of one (a resumed run with another
count), and every sample is still trained exactly once per epoch.

The order (`epoch_order`)
-------------------------
Training rows have global ids 0..n-1; shard i of the split holds ids [offset_i, offset_i +
rows_i). The shards are permuted by a generator seeded by (seed, epoch); consecutive permuted
shards form windows of `window` shards, and the rows inside each window are permuted. A window
bounds how many shards a reader needs at once (a whole dataset as one window is a full
shuffle); contiguous stretches of the order come from one window's shards.

The batches (`replica_batches`)
-------------------------------
An epoch is consumed in phases, each a `Phase(world W, batch b, steps done)`. Over the ids R
that earlier phases left (the whole order at the epoch's start), W replicas with batch b take
F = len(R) // (W*b) full steps: replica r's rows are the contiguous span R[r*F*b:(r+1)*F*b],
cut into F batches of b, so each replica reads its own shards. The tail T = R[W*F*b:] (fewer
than W*b ids) becomes one more step of `np.array_split(T, W)` when it has at least W ids or
there are no full steps; otherwise its ids go one each to the last batch of replicas
0..len(T)-1 (a batch of b + 1). Every replica therefore takes the same number of steps
(`epoch_steps`), every batch is non-empty, and every id of R is in exactly one batch.

A phase that stopped after s steps (a mid-epoch stop) leaves every replica's batches s..,
concatenated in replica order and then step order; the next phase, of any world, continues
over them. A position inside an epoch is thus a short list of phases (`Phase.to_dict`).

`sample_digest` is an order-independent digest of a set of ids: with the batches' row counts
adding up to n, their digests add up (mod 2**64) to `sample_digest(range(n))` when every id was
trained once (a repeat or a gap shows but for a 2**-64 chance), a check cheap enough for every
epoch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from collections.abc import Sequence

import numpy as np

from core.epoch_steps import epoch_steps
from core.errors import ZooidValueError

DEFAULT_WINDOW = 8
"""Shards per shuffle window."""

__all__ = ["DEFAULT_WINDOW", "Phase", "add_digests", "epoch_order", "epoch_steps", "remaining",
           "replica_batches", "sample_digest", "shard_offsets"]

_ORDER_STREAM = 0x5A4D
"""Tags the order's generator apart from the other (seed, epoch) streams (MLM masks, init)."""


def shard_offsets(shard_rows: Sequence[int]) -> np.ndarray:
    """The first global id of each shard: the cumulative rows before it."""
    rows = np.asarray(shard_rows, dtype=np.int64)
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(rows)[:-1]]) if len(rows) else rows


def epoch_order(shard_rows: Sequence[int], seed: int, epoch: int, window: int = DEFAULT_WINDOW) -> np.ndarray:
    """Every global training id once, in epoch `epoch`'s order (module docstring): shards
    permuted, then rows permuted within windows of `window` consecutive shards. int64."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ZooidValueError("window", f"must be a positive number of shards, got {window!r}")
    rows = np.asarray(shard_rows, dtype=np.int64)
    if (rows < 0).any():
        raise ZooidValueError("shard_rows", "a shard cannot have fewer than 0 rows")
    starts = shard_offsets(rows)
    rng = np.random.default_rng([seed, epoch, _ORDER_STREAM])
    shards = rng.permutation(len(rows))
    parts = []
    for first in range(0, len(shards), window):
        ids = np.concatenate([np.arange(starts[s], starts[s] + rows[s]) for s in shards[first:first + window]])
        parts.append(rng.permutation(ids))
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


@dataclass(frozen=True)
class Phase:
    """Part of an epoch trained by `world` replicas with batches of `batch` rows: `steps` steps."""

    world: int
    batch: int
    steps: int

    def __post_init__(self):
        for name in ("world", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ZooidValueError(name, f"must be a positive integer, got {value!r}")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ZooidValueError("steps", f"must be an integer >= 0, got {self.steps!r}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Phase:
        return cls(int(d["world"]), int(d["batch"]), int(d["steps"]))


def _cut(ids: np.ndarray, world: int, batch: int) -> list[list[np.ndarray]]:
    """Each replica's batches of `ids` (module docstring), by rank then step."""
    if 0 < len(ids) < world:
        raise ZooidValueError("workers", f"{world} workers but only {len(ids)} samples left in the epoch")
    full = len(ids) // (world * batch)
    span = full * batch
    per_rank = [[ids[r * span + s * batch : r * span + (s + 1) * batch] for s in range(full)] for r in range(world)]
    tail = ids[world * span:]
    if len(tail) >= world or (len(tail) and not full):
        for r, part in enumerate(np.array_split(tail, world)):
            per_rank[r].append(part)
    else:
        for r in range(len(tail)):
            per_rank[r][-1] = np.concatenate([per_rank[r][-1], tail[r : r + 1]])
    return per_rank


def remaining(order: np.ndarray, phases: Sequence[Phase]) -> np.ndarray:
    """The ids of `order` that `phases`, in turn, left untrained, in the order the next phase
    takes them."""
    left = np.asarray(order, dtype=np.int64)
    for phase in phases:
        per_rank = _cut(left, phase.world, phase.batch)
        steps = len(per_rank[0]) if per_rank else 0
        if phase.steps > steps:
            raise ZooidValueError("steps", f"a phase of {phase.world} x {phase.batch} has {steps} steps over "
                                  f"{len(left)} samples, not {phase.steps}")
        rest = [b for batches in per_rank for b in batches[phase.steps:]]
        left = np.concatenate(rest) if rest else np.empty(0, np.int64)
    return left


def replica_batches(order: np.ndarray, phases: Sequence[Phase], world: int, batch: int,
                    rank: int) -> list[np.ndarray]:
    """Replica `rank` of `world`'s batches of global ids over what `phases` left of `order`."""
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ZooidValueError("rank", f"must be in 0..{world - 1}, got {rank!r}")
    Phase(world, batch, 0)
    return _cut(remaining(order, phases), world, batch)[rank]


_MASK = np.uint64(2**64 - 1)


def sample_digest(ids) -> int:
    """An order-independent digest of `ids`: the sum mod 2**64 of a 64-bit mix (splitmix64) of
    each id. Digests of disjoint sets add up to the digest of their union."""
    z = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        return int(z.sum(dtype=np.uint64) & _MASK)


def add_digests(*digests: int) -> int:
    """Digests of disjoint sets of ids combined: their sum mod 2**64."""
    return sum(digests) % 2**64

"""A replica's share of one epoch's training data, as global row ids (issue #44: elastic determinism).

A replica's batches are the epoch's order (`engine.epoch_order.epoch_order`: a function of the
seed, the epoch and the dataset's shards alone, never of the world) cut for `world` replicas
over what the epoch's earlier phases left (`replica_batches`); its rows come through
`engine.shard_stream.ShardStream`. Local-SGD replicas (`engine.local_sgd_epoch`) and pipeline
replicas (`engine.pipeline_stage_worker`: replica r of D takes rank r's batches) take theirs
here, so hybrid D x M reads the same rows in the same steps as Local-SGD with D replicas.

A fresh epoch's step count is `epoch_steps(n_train, world, batch)` (`check_steps` refuses a
spec with another); a phase that continues an epoch another world stopped takes however many
steps its share of the remainder holds.

What a replica trained is tallied by count and order-independent digest (`tally`,
`engine.epoch_order.sample_digest`): its history record holds its phase's tally and the tally
of the earlier phases it continued (`earlier_tally`), and `epoch_coverage` adds an epoch's
records up; every sample was trained exactly once when that equals `dataset_tally(n_train)`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from core.errors import ZooidValueError
from engine.epoch_order import Phase, add_digests, epoch_order, epoch_steps, remaining, replica_batches, \
    sample_digest
from engine.shard_stream import split_rows
from engine.shards import DatasetManifest


def train_order(manifest: DatasetManifest, seed: int, epoch: int) -> np.ndarray:
    """Every training id of the dataset once, in epoch `epoch`'s order."""
    return epoch_order(split_rows(manifest, "train"), seed, epoch)


def replica_share(manifest: DatasetManifest, seed: int, epoch: int, phases: Sequence[Phase], world: int,
                  batch: int, rank: int) -> list[np.ndarray]:
    """Replica `rank` of `world`'s batches of global training ids in epoch `epoch`, over what
    `phases` (earlier phases of the epoch, oldest first) left."""
    return replica_batches(train_order(manifest, seed, epoch), phases, world, batch, rank)


def check_steps(steps: int, manifest: DatasetManifest, world: int, batch: int) -> None:
    """Refuse a spec whose `steps` is not a fresh epoch's for `world` replicas of `batch` rows."""
    want = epoch_steps(manifest.n_train, world, batch)
    if steps != want:
        raise ZooidValueError("steps", f"an epoch of {manifest.n_train} samples takes {want} steps for {world} "
                              f"replicas of batch {batch}, got {steps}")


def tally(batches: Sequence[np.ndarray]) -> dict[str, int]:
    """The count and digest of the ids in `batches`."""
    return {"samples": int(sum(len(b) for b in batches)),
            "digest": add_digests(*(sample_digest(b) for b in batches))}


def earlier_tally(manifest: DatasetManifest, seed: int, epoch: int, phases: Sequence[Phase]) -> dict[str, int]:
    """The count and digest of the ids `phases` trained (every replica of each)."""
    if not phases:
        return {"samples": 0, "digest": 0}
    order = train_order(manifest, seed, epoch)
    left = remaining(order, phases)
    return {"samples": len(order) - len(left),
            "digest": (sample_digest(order) - sample_digest(left)) % 2**64}


def dataset_tally(n: int) -> dict[str, int]:
    """The count and digest of an epoch that trained ids 0..n-1 once each."""
    return {"samples": n, "digest": sample_digest(np.arange(n))}


def epoch_coverage(records: Sequence[dict]) -> dict[str, int]:
    """What an epoch's completed Local-SGD attempts trained (`read_epoch_history` records): the
    last phase's replicas (each rank's last attempt) plus the earlier phases they continued. An
    epoch that trained every sample once gives `dataset_tally(n_train)`."""
    records = [r for r in records if "phase_tally" in r]
    if not records:
        raise ZooidValueError("history", "no record of this epoch holds a sample tally")
    # the last phase: that of the latest attempt among the records with the most phases (attempt
    # numbers only grow within an epoch, so an earlier try's records of another world drop out)
    latest = max(records, key=lambda r: (len(r["phases"]), r["attempt"]))
    final = {r["rank"]: r for r in records if (r["world"], r["phases"]) == (latest["world"], latest["phases"])}
    if sorted(final) != list(range(latest["world"])):
        raise ZooidValueError("history", f"the last phase's records are of ranks {sorted(final)} of "
                              f"{latest['world']}, not one whole world")
    parts = [latest["earlier_tally"]] + [r["phase_tally"] for r in final.values()]
    return {"samples": sum(p["samples"] for p in parts), "digest": add_digests(*(p["digest"] for p in parts))}

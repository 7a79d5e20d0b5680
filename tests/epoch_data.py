"""The rows each replica trains in an epoch, rebuilt for a reference run: every training row of a
staged dataset read once in global-id order, then indexed by the replica's batches from the same
sampler the workers use (`engine.replica_data`, `engine.epoch_order`)."""
from __future__ import annotations

import torch

from engine.datasets import read_manifest, read_subsets
from engine.epoch_order import epoch_steps
from engine.replica_data import replica_share

SMALL = "synthetic:64:10:96:32"
"""96 training rows of digits' width: an epoch of a few steps (2 replicas of batch 8: 6)."""


def all_rows(store, run_id: str, seed: int = 0, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every training row of the data staged for `run_id`, row i holding global id i."""
    manifest = read_manifest(store, run_id)
    return read_subsets(store, run_id, range(manifest.n_subsets), seed=seed, epoch=epoch)


def replica_rows(store, run_id: str, world: int, batch: int, seed: int = 0, epoch: int = 0,
                 phases=()) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per rank, the (x, y) of each of its batches in epoch `epoch`."""
    manifest = read_manifest(store, run_id)
    x, y = all_rows(store, run_id, seed, epoch)
    out = []
    for rank in range(world):
        batches = replica_share(manifest, seed, epoch, phases, world, batch, rank)
        out.append([(x[torch.from_numpy(ids)], y[torch.from_numpy(ids)]) for ids in batches])
    return out


def steps(store, run_id: str, world: int, batch: int) -> int:
    """A fresh epoch's steps per replica for the data staged for `run_id`."""
    return epoch_steps(read_manifest(store, run_id).n_train, world, batch)

"""A dataset whose inputs carry their sample id, and a model (by import path) that records the ids
it trains on: what an epoch trained, counted by sample id (`tests/test_elastic_epoch.py`).

`id_data`: N_TRAIN training rows whose first feature is the row's global id (exact in float32),
the rest seeded noise; N_VAL validation rows after them. `id_recorder(tag)`: a linear classifier
of the other features that, in training mode, appends the ids of every batch it is given to
`seen(tag)` (threads of one process share it).
"""
from __future__ import annotations

import threading

import torch
from torch import nn

N_TRAIN, N_VAL, FEATURES, CLASSES = 150, 20, 4, 5

_SEEN: dict[str, list[int]] = {}
_LOCK = threading.Lock()


def id_data():
    """((x_train, y_train), (x_val, y_val)) with each row's id in `x[:, 0]`."""
    n = N_TRAIN + N_VAL
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    y = torch.arange(n) % CLASSES
    return (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


class IdRecorder(nn.Module):
    """Records the ids of the rows it trains on under `tag`; classifies the other features."""

    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag
        self.linear = nn.Linear(FEATURES - 1, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            ids = x[:, 0].round().long().tolist()
            with _LOCK:
                _SEEN.setdefault(self.tag, []).extend(ids)
        return self.linear(x[:, 1:])


def id_recorder(tag: str = "") -> nn.Module:
    return IdRecorder(tag)


def seen(tag: str) -> list[int]:
    """Every id trained under `tag`, a repeat as often as it was trained."""
    with _LOCK:
        return list(_SEEN.get(tag, ()))

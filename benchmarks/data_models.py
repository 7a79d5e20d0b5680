"""Models the data benchmark names only by import path (`benchmarks.data_models:small_cnn`), on
`synthetic:3x32x32` rows.

Worker processes import this module, so it stays light (torch only).
"""
from __future__ import annotations

from torch import nn


def small_cnn(channels: int = 16, classes: int = 10) -> nn.Sequential:
    """Two 3x3 convolutions with ReLU and 2x2 pooling, then a linear head (33 k parameters): a
    step of 64 images takes tens of milliseconds on one CPU thread, so the data must arrive at
    tens of MB/s."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * channels * 8 * 8, classes),
    )


def linear(features: int = 3 * 32 * 32, classes: int = 10) -> nn.Sequential:
    """A linear classifier on the flattened image (31 k parameters): an epoch over gigabytes
    costs seconds of compute, so the memory run measures the data path."""
    return nn.Sequential(nn.Flatten(), nn.Linear(features, classes))

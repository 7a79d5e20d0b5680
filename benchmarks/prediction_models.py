"""Models the prediction benchmark names only by import path (`benchmarks.prediction_models:wide_mlp`).

Worker processes import this module, so it stays light (torch only). The profile cache keys
an import-path model by its path and a hash of this file's source: editing it makes the
next run profile the model again.
"""
from __future__ import annotations

from torch import nn


def wide_mlp(in_features: int = 64, hidden: int = 1024, classes: int = 10) -> nn.Sequential:
    """64 -> 1024 -> 1024 -> 10 ReLU perceptron on the 64-feature digits rows (1.1 M
    parameters): more compute per step and a larger sync than `digits_mlp`, with no entry in
    the model registry."""
    return nn.Sequential(
        nn.Linear(in_features, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def deep_cnn(channels: int = 32, classes: int = 10) -> nn.Sequential:
    """Three 3x3 convolutions (32, 32, 64 channels) on the 8x8 digits, then a 1024 -> 128 -> 10
    head (0.16 M parameters): about 6x `digits_cnn`'s multiply-adds per sample (1.9 M against 0.34 M), with no entry in the
    model registry. Takes flat 64-feature rows and reshapes them itself."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(2 * channels * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, classes),
    )

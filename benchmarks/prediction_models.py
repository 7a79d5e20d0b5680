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

"""A user's model factory, given to Zooid by import path in tests."""
from torch import nn


def tiny_mlp() -> nn.Module:
    """64 -> 16 -> 10, no BatchNorm."""
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

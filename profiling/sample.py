"""The synthetic batch a profile is measured on, shaped as the job's data, and the loss it scores.

A profile times the model on what its workers will feed it (`sample_batch`):

- class data (`input_dtype` "float32"): Gaussian rows of the job's input shape, integer labels
  [B] in [0, classes);
- token data (`input_dtype` "int64"): token ids [B, *input_shape] (a language model's [B, T],
  T the job's `seq_len`) in [0, classes), and targets of `target_shape` per sample ([T]: one
  token per position), also in [0, classes);
- float targets (`target_dtype` "float32", a custom loss's values: a regression's): Gaussian
  values of `target_shape` per sample.

`classes` is the dataset's label count, for tokens the vocabulary the targets use: every id
drawn is below it, so it is below the embedding's size wherever the dataset fits the model.
The loss (`profile_loss`) is the job's (`engine.objective`): by default cross-entropy over the
output's last dimension against integer targets of the output's shape minus that dimension,
positions whose target is -100 ignored; else the custom function the job's `loss` names.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from core.errors import ZooidValueError
from engine.objective import IGNORE_INDEX, objective_for

INPUT_DTYPES = ("float32", "int64")
"""What a sample's input is: float features, or integer token ids."""


def input_dtype_of(x: torch.Tensor) -> str:
    """The `INPUT_DTYPES` name of a dataset's inputs `x`: int64 for integer ids, else float32."""
    return "float32" if x.is_floating_point() else "int64"


def target_dtype_of(y: torch.Tensor) -> str:
    """The `INPUT_DTYPES` name of a dataset's targets `y`: float32 for values, else int64."""
    return "float32" if y.is_floating_point() else "int64"


def sample_batch(input_shape: Sequence[int], classes: int, rows: int, *, generator: torch.Generator,
                 input_dtype: str = "float32", target_shape: Sequence[int] = (), target_dtype: str = "int64",
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` synthetic samples `(x, y)` shaped as the job's data (module docstring), drawn from
    `generator` (inputs first, then targets), on `device`."""
    for label, value in (("input_dtype", input_dtype), ("target_dtype", target_dtype)):
        if value not in INPUT_DTYPES:
            raise ZooidValueError(label, f"must be one of {', '.join(INPUT_DTYPES)}, got {value!r}")
    if input_dtype == "int64":
        x = torch.randint(0, classes, (rows, *input_shape), generator=generator)
    else:
        x = torch.randn(rows, *input_shape, generator=generator)
    if target_dtype == "float32":
        y = torch.randn(rows, *target_shape, generator=generator)
    else:
        y = torch.randint(0, max(1, classes), (rows, *target_shape), generator=generator)
    return (x, y) if device is None else (x.to(device), y.to(device))


def profile_loss(output: torch.Tensor, target: torch.Tensor, loss: str | None = None) -> torch.Tensor:
    """The job's loss: the custom function `loss` names (`engine.objective.objective_for`), or
    the default objective's (`engine.objective.CROSS_ENTROPY`): cross-entropy over `output`'s
    last dimension against `target` (its shape minus that dimension: [B] for classes, [B, T] for
    tokens), positions whose target is -100 ignored; for [B, C] against [B] it is
    `nn.CrossEntropyLoss()`'s value. The default is written as one `F.cross_entropy` (the same
    value and the same tensors kept for backward) so that it also traces on `meta`, where the
    objective's count of scored positions cannot be read."""
    if loss:
        return objective_for(loss).loss(output, target)
    return F.cross_entropy(output.flatten(0, -2), target.flatten(), ignore_index=IGNORE_INDEX)

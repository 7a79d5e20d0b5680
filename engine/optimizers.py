"""Optimizers by name, and their per-parameter state as named tensors (no pickle).

State tensors are named `<parameter name>.<state key>` after `model.named_parameters()`,
e.g. `0.weight.momentum_buffer` or `2.bias.exp_avg_sq`, so a checkpoint stores them beside
the weights and the Local-SGD sync can average them by name. Hyperparameters (lr, betas)
are not state: they come from the worker spec each epoch.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from core.errors import ZooidValueError

OPTIMIZERS: dict[str, Callable[[Iterable[torch.Tensor], float], torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
}


def load_lazy_modules() -> None:
    """Build and drop one optimizer. The first optimizer a process builds makes torch import
    its compiler stack (`torch._dynamo` and more: 0.6 s of CPU on this machine); a worker
    does it while it starts, before it reports ready, so its first epoch (or profile) does
    not, the fork server does it once for every worker it forks, and the command line while
    its Prefect server boots (its staging builds an optimizer)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def validate_optimizer(name: str) -> None:
    """Raise ZooidValueError("optimizer", ...) unless `name` is a known optimizer."""
    if name not in OPTIMIZERS:
        raise ZooidValueError("optimizer", f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")


def build_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Optimizer `name` (`sgd`, `momentum` = SGD with momentum 0.9, `adam`) over `model`'s
    parameters with learning rate `lr`."""
    validate_optimizer(name)
    if not lr > 0:
        raise ZooidValueError("lr", f"must be positive, got {lr!r}")
    # a pipeline stage may hold no parameters (a reshape, an activation): give its optimizer
    # an empty placeholder so the stage still steps (a no-op) like every other stage
    params = list(model.parameters()) or [torch.zeros(0, requires_grad=True)]
    return OPTIMIZERS[name](params, lr)


def optimizer_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's state as `{param_name.key: tensor}`; the tensors are the live ones, so
    writing into them (`copy_`) changes the optimizer. Empty before the first step."""
    out = {}
    for pname, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{pname}.{key}"] = value
    return out


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Install state saved by `optimizer_state_tensors` (names must match the model's)."""
    params = dict(model.named_parameters())
    for name, value in tensors.items():
        pname, _, key = name.rpartition(".")
        if pname not in params:
            raise ZooidValueError("checkpoint", f"optimizer state {name!r} names no model parameter")
        p = params[pname]
        # Step counters stay on the CPU (as torch keeps them); moments live beside the weights.
        optimizer.state[p][key] = value.clone() if value.dim() == 0 else value.to(p.device, p.dtype, copy=True)

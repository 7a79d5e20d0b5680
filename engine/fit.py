"""Does this model take this data: the model checks the coordinator runs before anything is rented.

One call, `fit_model`, with plain inputs: the model's name and seed, the job's `loss`,
`objective` and pipeline (`pipelined`, `stages`), and the dataset's name, a sample of it and its
class count. In order:

- the model takes a sample and its outputs can be scored against the targets (`check_takes`:
  built without its weights, `engine.models.model_fit`; token ids against the embedding first,
  `engine.models.check_token_inputs`);
- a custom `loss` scores the model's output (`check_loss`: one forward on the CPU);
- a pipelined model has enough top-level layers, none sharing a parameter (`check_pipeline`).

It returns what every later step builds the model with (`Fit`), or raises one line naming the
field: `model`, `dataset`, `loss`, `stages`, or a text setting (`tokenizer`, `seq_len`,
`objective`). Nothing is trained and nothing is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from core.errors import ZooidValueError
from core.shared_parameters import shared_across
from engine.models import (build_model, check_token_inputs, data_model_kwargs, dataset_model_kwargs, model_fit,
                           models_that_fit, shape_model)
from engine.objective import check_custom_loss, resolve_loss
from engine.stages import sequential_children, shared_parameters


@dataclass(frozen=True)
class Fit:
    """What the checks found: how the model is built for this data."""

    model_kwargs: dict = field(default_factory=dict)
    """The factory's arguments the dataset decides (`engine.models.data_model_kwargs`)."""
    shared_parameters: tuple = ()
    """Parameters two top-level children hold (`engine.stages.shared_parameters`)."""
    parameter_bytes: int = 0
    """The model's parameters, in bytes (each shared one once); 0 where it could not be built for
    its shapes (`check_takes`) and is not pipelined."""


def fit_model(model: str, dataset: str, data, classes: int, *, seed: int = 0, loss: str | None = None,
              objective: str = "causal", pipelined: bool = False, stages: int | None = None) -> Fit:
    """Whether model `model` (seed `seed`) takes dataset `dataset` (`data`: a `DatasetSplit` or a
    sample of it, `classes` its class count or token vocabulary), is scored by the custom `loss`
    (None: cross-entropy), and, when `pipelined`, splits into `stages` stages (None: the planner
    chooses). `objective`: the data's own (a prepared text dataset's), else the job's. One line
    naming the field when it does not."""
    kwargs, built = check_takes(model, dataset, data, classes, seed=seed, loss=loss, objective=objective)
    shared = shared_parameters(built) if built is not None else ()
    if loss:
        check_loss(loss, model, data, seed=seed, model_kwargs=kwargs)
    if pipelined:
        built = built if built is not None else shape_model(model, seed, **kwargs)
        check_pipeline(model, built, stages)
    return Fit(model_kwargs=kwargs, shared_parameters=shared,
               parameter_bytes=sum(p.numel() * p.element_size() for p in built.parameters()) if built is not None else 0)


def _shape_text(shape) -> str:
    return "x".join(str(d) for d in shape) or "a scalar"


def check_takes(model: str, dataset: str, data, classes: int, *, seed: int = 0, loss: str | None = None,
                objective: str = "causal") -> tuple[dict, nn.Module | None]:
    """The model takes the dataset's samples and its outputs can be scored against the targets
    (`[B, C]` against `[B]`, `[B, T, V]` against `[B, T]`; not checked with a custom `loss`):
    built without its weights (`engine.models.model_fit`: the `meta` device, one row on the CPU,
    no gradients), on this machine, before anything is rented, with the arguments the dataset
    decides (`engine.models.data_model_kwargs`: a language model's vocabulary and mask token).
    Token inputs are checked first (`engine.models.check_token_inputs`: ids against the
    embedding, `seq_len` against the positions, `mlm` against the mask token). A mismatch is
    one line naming `model` and `dataset`, their shapes, and the registry models that fit the
    dataset. Returns the model's arguments and the model built for its shapes (None where it
    could not be built that way)."""
    kwargs = data_model_kwargs(model, data)
    try:
        built = shape_model(model, seed, **kwargs)
    except ZooidValueError:
        raise
    except Exception:  # a model that cannot be built: model_fit below says why, naming the pair
        built = None
    if built is not None:
        check_token_inputs(built, model, data, objective)
    sample = data.train_x[:1]
    target = None if loss else data.train_y[:1]
    scored = None if loss else classes  # a custom loss scores outputs of any shape
    problem, expected = model_fit(model, sample, scored, seed, target=target, model_kwargs=kwargs)
    if problem is None:
        return kwargs, built
    fit = [m for m in models_that_fit(sample, scored, target=target, data_kwargs=dataset_model_kwargs(data))
           if m != model]
    takes = f"; {model} takes {expected}" if expected else ""
    scores = (f"targets {_shape_text(target.shape[1:])} of {classes} token ids" if target is not None
              and target.dim() > 1 else f"{classes} classes")
    raise ZooidValueError("model", f"{model} does not fit dataset {dataset} (a sample is "
                          f"{_shape_text(sample.shape[1:])}, {scores}{takes}): {problem}; registry "
                          f"models that fit {dataset}: {', '.join(fit) if fit else 'none'}")


def check_loss(loss: str, model: str, data, *, seed: int = 0, model_kwargs: dict | None = None) -> None:
    """The custom `loss` imports, is a Python function outside the standard library, and scores
    the model's output for the first two training samples against their targets, returning one
    scalar (two rows: a loss per sample is caught too; `engine.objective.check_custom_loss`):
    the model built with its weights on the CPU, one forward without gradients.
    ZooidValueError naming `loss`."""
    resolve_loss(loss)
    net = build_model(model, seed, **(model_kwargs or {})).eval()
    rows = data.train_x[:2]
    with torch.no_grad():
        output = net(rows if rows.is_floating_point() else rows.long())
    check_custom_loss(loss, output, data.train_y[:2])


def check_pipeline(model: str, built: nn.Module, stages: int | None) -> None:
    """A pipeline needs a model (`built`: for its shapes, `engine.models.shape_model`) of at
    least `stages` top-level layers, none of whose parameters two children share (tied weights:
    refused naming the parameter)."""
    children = sequential_children(built)  # names the model if unsplittable
    problem = shared_across(shared_parameters(built), len(children))
    if problem:
        raise ZooidValueError("model", f"{model}: {problem}")
    if stages is not None and not 2 <= stages <= len(children):
        raise ZooidValueError("stages", f"must be 2..{len(children)} for {model} "
                              f"({len(children)} top-level layers), got {stages}")

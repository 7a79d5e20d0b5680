"""Split a model into contiguous pipeline stages and put the stages' weights back together.

A model can be split when its top-level children run one after another: an `nn.Sequential`,
or any module whose `forward` is, as `torch.fx` traces it, a plain chain
`child_0 -> child_1 -> ... -> output`. `cuts` name the child indices where stages 1..S-1
begin (FuncPipe's "partitioned after layer i", 1-based, is the same number): for five
children, `cuts=(2,)` gives stages `[0, 1]` and `[2, 3, 4]`.

Each stage is an `nn.Sequential` that keeps the children's original names, so a stage's
`state_dict` keys are exactly the unsplit model's keys for those layers. That makes the
canonical full-model checkpoint simply the union of the stages' state dicts, and slicing a
full checkpoint for a stage simply a filter, whatever the partition was when it was written.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

import torch
from torch import nn

from core.errors import ZooidValueError
from core.shared_parameters import SharedParameter, split_shared
from core.stage_memory import stage_bounds


def split_stages(model: nn.Module, cuts: Sequence[int]) -> list[nn.Module]:
    """Split `model` at the child indices in `cuts` into `len(cuts) + 1` stage modules.

    The stages share parameters with `model` (no copy). Raises `ZooidValueError` naming the
    model when its children do not run in order or when two stages would hold one parameter
    (tied weights, `core.shared_parameters`), or naming `cuts` when they are invalid.
    """
    children = sequential_children(model)
    try:
        bounds = stage_bounds(cuts, len(children))
    except ZooidValueError as exc:  # the same check, its message naming the model
        raise ZooidValueError("cuts", f"{type(model).__name__} has {len(children)} children: "
                                      f"{str(exc).removeprefix('cuts: ')}") from None
    problem = split_shared(shared_parameters(model), cuts, len(children))
    if problem:
        raise ZooidValueError("model", problem)
    return [nn.Sequential(OrderedDict(children[first:last + 1])) for first, last in bounds]


def sequential_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The `(name, child)` pairs of a model whose top-level children run in order.

    Raises `ZooidValueError` (field `model`) naming the model class when it cannot be
    split: parameters or buffers of its own, or a `forward` that is not a plain chain.
    """
    name = type(model).__name__
    children = list(model.named_children())
    if not children:
        raise ZooidValueError("model", f"{name} has no child modules to split into stages")
    own = [n for n, _ in model.named_parameters(recurse=False)]
    own += [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise ZooidValueError(
            "model", f"{name} holds tensors outside its children ({', '.join(own)}); "
            "only children can be placed on stages")
    if isinstance(model, nn.Sequential):
        return children
    order = _traced_chain(model)
    if order != [n for n, _ in children]:
        raise ZooidValueError(
            "model", f"{name}.forward does not call its children once each in order "
            f"(traced {order or 'other operations'}); wrap the model in nn.Sequential "
            "or move the extra operations into child modules")
    return children


def shared_parameters(model: nn.Module) -> tuple[SharedParameter, ...]:
    """The parameters that two top-level children or more hold (tied weights), each as its
    name in `model.named_parameters()` and the indices of the children holding it, in the
    order `named_parameters` gives them; empty when no child shares one."""
    holders: dict[int, list[int]] = {}
    for index, child in enumerate(model.children()):
        for param in child.parameters():
            holders.setdefault(id(param), []).append(index)
    return tuple((name, tuple(holders[id(p)])) for name, p in model.named_parameters()
                 if len(holders.get(id(p), ())) > 1)


def _traced_chain(model: nn.Module) -> list[str]:
    """Names of the children `forward` calls, when it is a plain chain; else []."""
    import torch.fx  # imported here: tracing is needed only for non-Sequential models

    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - any trace failure means "not a plain chain"
        return []
    nodes = list(graph.nodes)
    if len(nodes) < 3 or nodes[0].op != "placeholder" or nodes[-1].op != "output":
        return []
    if sum(n.op == "placeholder" for n in nodes) != 1:
        return []
    order, previous = [], nodes[0]
    for node in nodes[1:-1]:
        # Each call must consume exactly the previous node's output and nothing else.
        if node.op != "call_module" or list(node.args) != [previous] or node.kwargs:
            return []
        if "." in node.target:  # a grandchild called directly is not a top-level chain
            return []
        order.append(node.target)
        previous = node
    if list(nodes[-1].args) != [previous]:
        return []
    return order


def stage_state_dicts(stages: Sequence[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Each stage's state dict under the full model's keys (detached tensors)."""
    return [{k: v.detach() for k, v in stage.state_dict().items()} for stage in stages]


def assemble_full_state(
    stage_states: Sequence[Mapping[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Merge per-stage state dicts into the canonical full-model state dict.

    Raises `ZooidValueError` (field `stage_states`) when two stages claim the same key.
    """
    full: dict[str, torch.Tensor] = {}
    for index, state in enumerate(stage_states):
        clash = sorted(set(full) & set(state))
        if clash:
            raise ZooidValueError(
                "stage_states", f"stage {index} repeats keys of an earlier stage: {clash[:3]}")
        full.update(state)
    return full


def slice_full_state(
    full_state: Mapping[str, torch.Tensor], stage: nn.Module,
) -> dict[str, torch.Tensor]:
    """The entries of a canonical full-model state dict that belong to `stage`.

    Raises `ZooidValueError` (field `full_state`) listing keys the stage needs but the
    checkpoint lacks.
    """
    wanted = list(stage.state_dict().keys())
    missing = [k for k in wanted if k not in full_state]
    if missing:
        raise ZooidValueError("full_state", f"checkpoint lacks stage keys {missing[:3]}")
    return {k: full_state[k] for k in wanted}

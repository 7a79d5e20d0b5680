"""Parameters shared between a model's top-level children (tied weights), against stage cuts.

A pipeline keeps each stage's parameters on its own worker and sums no gradient across stages,
so a parameter held by two children (a language model's token embedding tied to its vocabulary
head) cannot be split between two stages: it is refused in one line naming the parameter.
Local-SGD trains such a model whole and is unaffected. A shared parameter is described as
`(name, children)`: its name in the model's `named_parameters()` and the indices of the
top-level children that hold it (`engine.stages.shared_parameters` finds them).
"""
from __future__ import annotations

from typing import Sequence

from core.stage_memory import stage_bounds

SharedParameter = tuple[str, tuple[int, ...]]
"""A parameter's name and the top-level children (indices, increasing) that hold it."""

REMEDY = "train it with strategy=local_sgd, or untie it (the registry's language models: tie_embeddings=False)"


def _children_text(children: Sequence[int]) -> str:
    return ", ".join(map(str, children[:-1])) + f" and {children[-1]}"


def split_shared(shared: Sequence[SharedParameter], cuts: Sequence[int], num_layers: int) -> str | None:
    """The first shared parameter that stage-start `cuts` (as `core.stage_memory.stage_bounds`
    takes them) put on two stages or more, as one line; None when every one stays on one stage."""
    bounds = stage_bounds(cuts, num_layers)
    for name, children in shared:
        stages = sorted({next(s for s, (a, b) in enumerate(bounds) if a <= c <= b) + 1 for c in children})
        if len(stages) > 1:
            return (f"parameter {name!r} is shared by children {_children_text(children)}, which stages "
                    f"{_children_text(stages)} would hold; a pipeline cannot keep one parameter on two stages: "
                    f"{REMEDY}")
    return None


def shared_across(shared: Sequence[SharedParameter], num_layers: int) -> str | None:
    """For a pipeline whose cuts are not known yet: the first shared parameter that a cut could
    put on two stages, as one line (held by the first and the last child: every pipeline
    splits it); None when no parameter is shared between children."""
    for name, children in shared:
        if len(children) > 1:
            where = ("the first and the last stage of every pipeline would hold"
                     if children[0] == 0 and children[-1] == num_layers - 1 else
                     "a pipeline cut between them would put on two stages")
            return (f"parameter {name!r} is shared by children {_children_text(children)}, which {where}; "
                    f"a pipeline cannot keep one parameter on two stages: {REMEDY}")
    return None

"""The loss and the metrics: one place for what a step minimises and what a run reports.

Cross-entropy (the default): a model's output `[B, ..., V]` is scored against integer
targets of the output's shape minus its last dimension, `[B, ...]`, at every position, and
positions whose target is `IGNORE_INDEX` (-100, PyTorch's `ignore_index`) are not scored.
Classification, `[B, C]` against `[B]`, is the case without positions; a language model's
`[B, T, V]` against `[B, T]` (next tokens, or MLM's masked positions) the case with them.

A custom loss (the job field `loss`): `package.module:function(output, target) -> scalar`,
the mean over the batch's samples of whatever it scores (a regression's MSE, say).

Sums and counts, so every strategy takes the same step on the same batch: `loss_sum` is
the batch's summed loss and `scored` the count it is a mean over (scored positions for
cross-entropy, samples for a custom loss; `divisor`, the same count kept on the device).
Local-SGD minimises `loss` (the whole batch's mean); a pipeline splits the batch into
micro-batches and minimises each one's `loss_sum / scored(whole batch)` (`part_loss`), whose
sum over the micro-batches is that same mean (a micro-batch's mean scaled by its share of the
rows would not be, once positions are ignored).
A custom loss is split by rows: its micro-batch term is its mean times rows / batch rows.

Metrics follow the targets (`target_kind`): `classes` ([B] integers): loss and accuracy;
`tokens` ([B, T] integers): loss (the mean token loss), perplexity (its exponential) and
token accuracy over the scored positions, and the tokens trained (positions per sample times
samples, ignored positions included: the input tokens a causal or masked LM reads); `custom`:
the loss alone. `Tally` sums a validation pass; `Metrics` is what a worker reports.

A profile times the model under cross-entropy against synthetic targets of the data's shape
(`profiling.sample`); a custom loss's own cost is not profiled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from core.errors import ZooidValueError
from engine.user_code import import_callable

IGNORE_INDEX = -100
"""A target position with this value is not scored (PyTorch's `ignore_index`)."""

CLASSES, TOKENS, CUSTOM = "classes", "tokens", "custom"
"""What the targets are (`target_kind`), which decides the metrics."""

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_loss(path: str) -> LossFunction:
    """The function a job's `loss` names (`package.module:function`), imported and checked
    to be a Python callable outside the standard library; ZooidValueError("loss", ...) else.
    It is not called here (`check_loss` runs it on a model's output)."""
    return import_callable(path, "loss", "a loss function")


def target_kind(target: torch.Tensor, custom: bool = False) -> str:
    """`custom` under a custom loss; else `classes` for one integer per sample ([B]) and
    `tokens` for integers per position ([B, T, ...])."""
    if custom:
        return CUSTOM
    return CLASSES if target.dim() <= 1 else TOKENS


def target_classes(*targets: torch.Tensor) -> int:
    """The classes (or vocabulary) integer targets use: the largest scored target + 1, ignored
    positions left out; 0 for float targets (a custom loss's) or none scored."""
    top = -1
    for t in targets:
        if t.is_floating_point() or t.is_complex():
            return 0
        scored = t[t != IGNORE_INDEX]
        if scored.numel():
            top = max(top, int(scored.max()))
    return top + 1


def shapes_problem(output_shape, target_shape, target_dtype: torch.dtype) -> str | None:
    """Why cross-entropy cannot score an output of `output_shape` against targets of
    `target_shape` and `target_dtype` (both batched), or None when it can: the targets must
    be integers shaped as the output without its last dimension."""
    output_shape, target_shape = tuple(output_shape), tuple(target_shape)
    shape = lambda s: "x".join(map(str, s)) or "a scalar"  # noqa: E731
    if target_dtype.is_floating_point or target_dtype.is_complex or target_dtype == torch.bool:
        return f"cross-entropy needs integer targets, got {str(target_dtype).removeprefix('torch.')} (give a `loss`)"
    if len(output_shape) < 2 or output_shape[:-1] != target_shape:
        return (f"outputs of shape {shape(output_shape)} cannot be scored against targets of shape "
                f"{shape(target_shape)} (cross-entropy over the output's last dimension needs targets of "
                f"shape {shape(output_shape[:-1])})")
    return None


@dataclass(frozen=True)
class Metrics:
    """What one validation pass reports (None where the targets have no such figure)."""

    loss: float | None = None
    accuracy: float | None = None
    """Class targets: the fraction of samples whose largest output is their class."""
    perplexity: float | None = None
    """Token targets: exp of the mean token loss."""
    token_accuracy: float | None = None
    """Token targets: the fraction of scored positions whose largest output is their target."""

    def result_fields(self) -> dict[str, float | None]:
        """As `core.specs.WorkerResult`'s validation fields."""
        return {"val_loss": self.loss, "val_accuracy": self.accuracy, "val_perplexity": self.perplexity,
                "val_token_accuracy": self.token_accuracy}


def perplexity(mean_token_loss: float) -> float:
    """exp of a mean token loss (inf beyond what a float holds)."""
    return math.exp(mean_token_loss) if mean_token_loss < 709 else math.inf


@dataclass
class Tally:
    """Running sums of a pass over data (`Objective.tally` adds a batch)."""

    kind: str = CLASSES
    loss_sum: float = 0.0
    scored: int = 0
    correct: int = 0

    def metrics(self) -> Metrics:
        """The pass's figures for its kind of targets."""
        if not self.scored:
            return Metrics()
        loss = self.loss_sum / self.scored
        if self.kind == CLASSES:
            return Metrics(loss=loss, accuracy=self.correct / self.scored)
        if self.kind == TOKENS:
            return Metrics(loss=loss, perplexity=perplexity(loss), token_accuracy=self.correct / self.scored)
        return Metrics(loss=loss)


class Objective:
    """The loss a job trains with: cross-entropy (`loss` None or empty) or the custom function
    `loss` names. Every place that computes a loss or a metric goes through one of these."""

    def __init__(self, loss: str | None = None):
        self.name = loss or ""
        self.custom: LossFunction | None = resolve_loss(loss) if loss else None

    def kind(self, target: torch.Tensor) -> str:
        """`classes`, `tokens` or `custom` (see `target_kind`)."""
        return target_kind(target, self.custom is not None)

    def scored(self, target: torch.Tensor) -> int:
        """How many units the batch's loss is a mean over: scored positions for cross-entropy,
        samples for a custom loss."""
        if self.custom is not None:
            return len(target)
        return int((target != IGNORE_INDEX).sum())

    def divisor(self, target: torch.Tensor) -> torch.Tensor | int:
        """`scored`, at least 1, as what the loss divides by: for cross-entropy a tensor on the
        target's device, so a step waits for no copy to the host."""
        if self.custom is not None:
            return len(target)
        return (target != IGNORE_INDEX).sum().clamp(min=1)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (what a Local-SGD replica minimises)."""
        if self.custom is not None:
            return self._custom(output, target)
        if output.dim() == 2 and target.dim() == 1:
            return F.cross_entropy(output, target, ignore_index=IGNORE_INDEX)
        return self.loss_sum(output, target) / self.divisor(target)

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The batch's summed loss: `loss` times `scored` (custom: its mean times the rows)."""
        if self.custom is not None:
            return self._custom(output, target) * len(target)
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def part_loss(self, output: torch.Tensor, target: torch.Tensor, batch_scored: torch.Tensor | int,
                  batch_rows: int) -> torch.Tensor:
        """A micro-batch's term of its batch's mean loss: summed over the micro-batches it is
        `loss` of the whole batch (`batch_scored`: `divisor` (or `scored`) of the whole batch,
        `batch_rows` its rows)."""
        if self.custom is not None:
            return self._custom(output, target) * (len(target) / batch_rows)
        if isinstance(batch_scored, int):
            batch_scored = max(1, batch_scored)
        return self.loss_sum(output, target) / batch_scored

    def _custom(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = self.custom(output, target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ZooidValueError("loss", f"{self.name} must return a scalar tensor, got "
                                  f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        return value.reshape(())

    @torch.no_grad()
    def tally(self, output: torch.Tensor, target: torch.Tensor, into: Tally) -> Tally:
        """Add one batch's loss sum, scored count and (cross-entropy) correct predictions."""
        into.kind = self.kind(target)
        into.loss_sum += float(self.loss_sum(output, target))
        into.scored += self.scored(target)
        if self.custom is None:
            scored = target != IGNORE_INDEX
            into.correct += int(((output.argmax(-1) == target) & scored).sum())
        return into

    def tokens(self, target: torch.Tensor) -> int:
        """Tokens in `target`'s rows when they are token targets: positions per sample times
        samples, ignored positions included (the input tokens the model read); else 0."""
        return target.numel() if self.kind(target) == TOKENS else 0


CROSS_ENTROPY = Objective()
"""The default objective (no custom loss)."""


def objective_for(loss: str | None) -> Objective:
    """The job's objective: `CROSS_ENTROPY`, or one around the custom function `loss` names."""
    return Objective(loss) if loss else CROSS_ENTROPY


def check_custom_loss(loss: str, output: torch.Tensor, target: torch.Tensor) -> None:
    """That the custom function `loss` names scores a model's `output` for a few samples against
    their `target` and returns one scalar; ZooidValueError("loss", ...) naming both shapes
    otherwise (its import is checked first, `resolve_loss`)."""
    objective = Objective(loss)
    shapes = (f"an output of shape {'x'.join(map(str, output.shape)) or 'a scalar'} against a target of shape "
              f"{'x'.join(map(str, target.shape)) or 'a scalar'}")
    try:
        objective.loss(output, target)
    except ZooidValueError:
        raise
    except Exception as exc:  # a user's function can fail any way; that is bad input
        text = str(exc).strip().splitlines()
        raise ZooidValueError("loss", f"{loss} failed on {shapes}: {type(exc).__name__}: "
                              f"{text[0] if text else ''}".rstrip(": ")) from None

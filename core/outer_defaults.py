"""DiLoCo's outer settings as they follow the sync period (standard library only).

The outer step (`core.outer_sync`, `engine.outer`) turns a round's mean change Δ into
θ ← θ − η (Δ + μ m), m ← μ m + Δ. Over a run of like rounds m settles at Δ / (1 − μ), so the
outer step moves the weights by

    gain = η / (1 − μ)

times the round's change: 1 for K-AVG (η 1, μ 0), 7 for DiLoCo's published η 0.7, μ 0.9.
That gain multiplies what the inner optimizer did, whose own momentum has already multiplied
each gradient by 1 / (1 − β) (10 for SGD's and Adam's 0.9): the outer momentum piles on top of
the inner one. DiLoCo's 7x was tuned at 500 inner steps a round with an inner learning rate
that decays; Zooid's inner learning rate is constant, and with it every gain above K-AVG's 1
raised the level a run ends at in the measurements (BENCHMARKS.md): a bound growing like √k
(7 at 500 steps) lost 1.8 and 1.9 points to K-AVG on `digits_cnn` at 32 and 45 steps (gains
1.77 and 2.1), one growing in proportion to the round lost 1.1, 3.3 and 3.4 on 512-step
epochs of a synthetic task at rounds of 128, 256 and 512 steps (gains 1.79, 3.6 and 7). So the
bound is K-AVG's gain at every period:

    max_outer_gain(k) = 1

and the defaults keep DiLoCo's outer learning rate, 0.7, with the momentum that gives that
gain: μ = 1 − 0.7 = 0.3, a short outer memory (the outer step smooths rounds rather than
extrapolating them); on that synthetic task (seeds not used before) it ended 0.6, 0.5 and
0.2 points above K-AVG at 128, 256 and 512 steps. At the shortest periods the inner momentum still carries most of
the last round's motion into the next one (a fraction β^k of its velocity survives a round,
β = `INNER_MOMENTUM`): the outer momentum may carry only the rest, μ <= 0.9 (1 − β^k), which
binds at k <= 3 (0.09 at k = 1, 0.17 at 2, 0.24 at 3). A round is the sync period, or the
epoch when the job syncs once an epoch or its period is longer than an epoch (`round_steps`).

Why keep the outer lr and not the momentum (η = 0.1 with μ 0.9 has gain 1 too)? With μ 0.9
the outer step takes a tenth of each round's change and leans on ten rounds of memory; a
small μ keeps the outer memory as short as the rounds are. On a quadratic (heavy-ball SGD,
β 0.9, inside the replicas, its state averaged as Zooid does), DiLoCo's 0.7 / 0.9 diverges for
every curvature at k <= 4, and at k = 8 for curvatures from 0.78 of the inner optimizer's own
stability limit up; the rule's settings are stable up to 0.87 of that limit at k = 3 and 4,
0.94 from k = 5, and to the limit itself at k = 1 and 2. Measured
(`benchmarks/bench_diloco_defaults.py`, BENCHMARKS.md): 2 replicas, 6 epochs, on digits (CNNs
and an MLP) and on `synthetic:64:10:16384`.

Explicit settings are the user's: the job keeps them and `outer_settings` says, in one line,
when their gain exceeds the rule's bound for the period. One of the two given: the other
follows the bound (momentum 1 − η; outer lr 1 − μ).
"""
from __future__ import annotations

from dataclasses import dataclass

from core.outer_sync import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM

MAX_GAIN = 1.0
"""K-AVG's gain: the most the defaults amplify a round's change at any period (module docstring)."""
INNER_MOMENTUM = 0.9
"""The inner optimizers' momentum (SGD's `momentum`, Adam's β1; plain `sgd` has none, and the
cap it sets is then only cautious)."""
MAX_FOLLOWED_LR = 1.0
"""The largest outer lr the rule gives when only the momentum is set (1 with μ 0 is K-AVG)."""


def outer_gain(lr: float, momentum: float) -> float:
    """How much the outer step multiplies a run of like rounds' change: lr / (1 − momentum)."""
    return lr / (1.0 - momentum)


def round_steps(sync_period: int | None, steps_per_epoch: int) -> int:
    """Inner steps in a round: the period, or the epoch's steps when the job syncs once an
    epoch (`sync_period` None) or the period is longer than an epoch (the epoch ends a round)."""
    steps = max(1, int(steps_per_epoch))
    return steps if sync_period is None else max(1, min(int(sync_period), steps))


def max_outer_gain(steps: int) -> float:
    """The rule's bound on `outer_gain` for rounds of `steps` inner steps (module docstring)."""
    return MAX_GAIN


def max_outer_momentum(steps: int) -> float:
    """The outer momentum the inner momentum leaves room for: 0.9 (1 − β^steps)."""
    return DEFAULT_OUTER_MOMENTUM * (1.0 - INNER_MOMENTUM ** max(1, steps))


@dataclass(frozen=True)
class OuterSettings:
    """The `nesterov` outer step's lr and momentum for rounds of `steps` inner steps."""

    lr: float
    momentum: float
    steps: int
    followed: tuple[str, ...]
    """The fields the rule chose (the others were the user's)."""

    @property
    def gain(self) -> float:
        return outer_gain(self.lr, self.momentum)

    @property
    def max_gain(self) -> float:
        return max_outer_gain(self.steps)

    @property
    def unstable(self) -> bool:
        """Whether the settings amplify a round's change beyond the rule's bound, or carry more
        momentum than the inner momentum leaves room for."""
        return (self.gain > self.max_gain * (1 + 1e-9)
                or self.momentum > max_outer_momentum(self.steps) * (1 + 1e-9))

    def line(self) -> str:
        """One line for the run's log: what was chosen and why, or the warning."""
        given = " and ".join(f for f in ("outer_lr", "outer_momentum") if f not in self.followed)
        values = f"outer_lr {self.lr:.3g}, outer_momentum {self.momentum:.3g} on {self.steps}-step rounds"
        if self.unstable:
            cap = max_outer_momentum(self.steps)
            why = [f"gain {self.gain:.2f}x above the {self.max_gain:.2f}x they bear"] if \
                self.gain > self.max_gain * (1 + 1e-9) else []
            why += [f"momentum above the {cap:.3g} the inner momentum leaves room for"] if \
                self.momentum > cap * (1 + 1e-9) else []
            return (f"{given}: {values}: {' and '.join(why)} (core.outer_defaults); expect oscillation, "
                    f"or leave {given} null to follow the sync period")
        if not self.followed:
            return f"outer step nesterov: {values}, as set (gain {self.gain:.2f}x)"
        return (f"outer step nesterov: {values}; {' and '.join(self.followed)} followed the sync period "
                f"(gain {self.gain:.2f}x, at most {self.max_gain:.2f}x: core.outer_defaults)")


def outer_settings(steps: int, lr: float | None = None, momentum: float | None = None) -> OuterSettings:
    """The outer lr and momentum for rounds of `steps` inner steps: the user's where given
    (None: follow the rule, module docstring)."""
    bound = max_outer_gain(steps)
    followed = tuple(f for f, v in (("outer_lr", lr), ("outer_momentum", momentum)) if v is None)
    if lr is None and momentum is not None:
        lr = min(MAX_FOLLOWED_LR, bound * (1.0 - momentum))
    lr = DEFAULT_OUTER_LR if lr is None else lr
    if momentum is None:
        momentum = min(max_outer_momentum(steps), max(0.0, 1.0 - lr / bound))
    return OuterSettings(lr=lr, momentum=momentum, steps=max(1, steps), followed=followed)

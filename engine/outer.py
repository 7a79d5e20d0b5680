"""The outer step of a Local-SGD round (K-AVG or DiLoCo) and what a round syncs.

At a sync every replica holds θ_i, k inner steps away from the round's start θ_global (the
same on every replica: the previous sync's result, or the epoch's start).

- `average` (K-AVG, KubeML Eq. 3.1): θ_global ← mean_i θ_i.
- `nesterov` (DiLoCo): the outer gradient Δ = θ_global − mean_i θ_i drives SGD with Nesterov
  momentum μ and learning rate η on the replicas' common state: m ← μ m + Δ,
  θ_global ← θ_global − η (Δ + μ m). η = 1, μ = 0 is `average`.

The outer step applies to the parameters; float buffers (batch-norm statistics) and the
inner optimizer's state are averaged in both, as K-AVG always did.

What a round sends: with `float32` syncs the live values (today's bytes and arithmetic, so
`average` reproduces K-AVG bit for bit); a compressed sync (`comm.compression`) sends each
replica's change since the round's start, θ_i − θ_global, which is small and rounds well,
and the mean change is added back to θ_global. Buffers (names `buffer/`: batch-norm running
means and variances) are sent as they are even then, and travel exactly
(`engine.local_sgd` marks them for the compressor): their result is the plain mean of the
replicas' values, so a running variance never comes back below zero.

The outer state every replica holds alike, `momentum` (parameter name -> buffer), is
checkpointed with the weights (`state_tensors` / `load_state_tensors`, names under
`outer/`); θ_global is the checkpointed weights themselves.
"""
from __future__ import annotations

import torch

from core.errors import ZooidValueError
from core.outer_sync import OUTER_OPTIMIZERS

STATE_PREFIX = "outer/momentum/"
BUFFER_PREFIX = "buffer/"
"""Names of a model's buffers among the shared tensors (`engine.local_sgd.LocalSGD`)."""


class OuterStep:
    """The outer optimizer of one replica's rounds; `start` snapshots θ_global."""

    def __init__(self, optimizer: str = "average", lr: float = 1.0, momentum: float = 0.0,
                 deltas: bool = False):
        if optimizer not in OUTER_OPTIMIZERS:
            raise ZooidValueError("outer_optimizer", f"must be one of {', '.join(OUTER_OPTIMIZERS)}, got {optimizer!r}")
        if not lr > 0:
            raise ZooidValueError("outer_lr", f"must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ZooidValueError("outer_momentum", f"must be in [0, 1), got {momentum!r}")
        self.optimizer, self.lr, self.mu, self.deltas = optimizer, lr, momentum, deltas
        self.ref: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}

    @property
    def plain(self) -> bool:
        """K-AVG on raw values: the mean is the result, no snapshot needed."""
        return self.optimizer == "average" and not self.deltas

    def start(self, live: dict[str, torch.Tensor]) -> None:
        """θ_global (and the other shared tensors) as the round starts."""
        if not self.plain:
            self.ref = {n: t.detach().clone() for n, t in live.items()}

    def _ref(self, name: str, like: torch.Tensor) -> torch.Tensor:
        ref = self.ref.get(name)
        # the inner optimizer's state appears at its first step: it started from zero
        return ref if ref is not None and ref.shape == like.shape else torch.zeros_like(like)

    def _sends_delta(self, name: str) -> bool:
        """Whether tensor `name` travels as its change since `start` (buffers never do)."""
        return self.deltas and not name.startswith(BUFFER_PREFIX)

    def payload(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this replica sends: the live values, or their change since `start` (the
        buffers' live values)."""
        if not self.deltas:
            return live
        return {n: t.detach() - self._ref(n, t) if self._sends_delta(n) else t.detach() for n, t in live.items()}

    def apply(self, live: dict[str, torch.Tensor], reduced: dict[str, torch.Tensor]) -> None:
        """Write the round's result into `live` from the mean of the payloads, and start the
        next round from it."""
        with torch.no_grad():
            for name, t in live.items():
                mean = reduced[name].to(t.device)
                if self._sends_delta(name):
                    mean = self._ref(name, t) + mean
                if self.optimizer == "nesterov" and name.startswith("param/"):
                    ref = self._ref(name, t)
                    delta = ref - mean
                    m = self.momentum.get(name)
                    m = delta.clone() if m is None else m.mul_(self.mu).add_(delta)
                    self.momentum[name] = m
                    mean = ref - self.lr * (delta + self.mu * m)
                if mean is not t:
                    t.copy_(mean)
        self.start(live)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The outer state for a checkpoint (empty for K-AVG and before the first round)."""
        return {f"{STATE_PREFIX}{n}": m for n, m in self.momentum.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
        """Install state from `state_tensors` (other names are ignored)."""
        self.momentum = {n.removeprefix(STATE_PREFIX): t.to(device) if device is not None else t.clone()
                         for n, t in tensors.items() if n.startswith(STATE_PREFIX)}

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
REF_PREFIX = "outer/ref/"
"""A handover's names for the round-start snapshot (`OuterStep.ref_tensors`)."""
PARAM_PREFIX = "param/"
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
        """θ_global as the round starts: a snapshot of each tensor whose start `payload` or
        `apply` reads (`_reads_ref`); none for K-AVG on raw values."""
        if not self.plain:
            self.ref = {n: t.detach().clone() for n, t in live.items() if self._reads_ref(n)}

    def _ref(self, name: str, like: torch.Tensor) -> torch.Tensor:
        ref = self.ref.get(name)
        # the inner optimizer's state appears at its first step: it started from zero
        return ref if ref is not None and ref.shape == like.shape else torch.zeros_like(like)

    def _sends_delta(self, name: str) -> bool:
        """Whether tensor `name` travels as its change since `start` (buffers never do)."""
        return self.deltas and not name.startswith(BUFFER_PREFIX)

    def _reads_ref(self, name: str) -> bool:
        """Whether the round reads tensor `name`'s value at its start: it travels as its change,
        or it is a parameter of a `nesterov` step. Every other tensor takes the mean as it is,
        so `start` copies only these (a float32 DiLoCo round copies the parameters, not the
        inner optimizer's state)."""
        return self._sends_delta(name) or (self.optimizer == "nesterov" and name.startswith(PARAM_PREFIX))

    def payload(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this replica sends: the live values, or their change since `start` (the
        buffers' live values)."""
        if not self.deltas:
            return live
        names = [n for n in live if self._sends_delta(n)]
        changes = dict(zip(names, torch._foreach_sub([live[n].detach() for n in names],
                                                     [self._ref(n, live[n]) for n in names])))
        return {n: changes[n] if n in changes else t.detach() for n, t in live.items()}

    def apply(self, live: dict[str, torch.Tensor], reduced: dict[str, torch.Tensor]) -> None:
        """Write the round's result into `live` from the mean of the payloads, and start the
        next round from it (the results just computed are the next round's snapshot: no second
        copy). Each step runs over all the tensors it concerns at once (`torch._foreach_*`:
        the same arithmetic, tensor by tensor, as one call)."""
        with torch.no_grad():
            names = list(live)
            means = {n: reduced[n].to(live[n].device) for n in names}
            sent = [n for n in names if self._sends_delta(n)]
            if sent:
                means.update(zip(sent, torch._foreach_add([self._ref(n, live[n]) for n in sent],
                                                          [means[n] for n in sent])))
            if self.optimizer == "nesterov":
                params = [n for n in names if n.startswith(PARAM_PREFIX)]
                if params:
                    means.update(zip(params, self._nesterov(params, [self._ref(n, live[n]) for n in params],
                                                            [means[n] for n in params])))
            changed = [n for n in names if means[n] is not live[n]]
            if changed:
                torch._foreach_copy_([live[n] for n in changed], [means[n] for n in changed])
            if not self.plain:
                self.ref = {n: means[n] if means[n] is not live[n] else live[n].detach().clone()
                            for n in names if self._reads_ref(n)}

    def _nesterov(self, names: list[str], refs: list[torch.Tensor], means: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outer Nesterov step of parameters `names` from their round-start values `refs`
        and the replicas' mean `means`: Δ = ref − mean, m ← μ m + Δ (m = Δ at the first round),
        the new θ_global = ref − η (Δ + μ m)."""
        deltas = torch._foreach_sub(refs, means)
        held = [i for i, n in enumerate(names) if n in self.momentum]
        if held:
            momenta = [self.momentum[names[i]] for i in held]
            torch._foreach_mul_(momenta, self.mu)
            torch._foreach_add_(momenta, [deltas[i] for i in held])
        for n, d in zip(names, deltas):
            if n not in self.momentum:
                self.momentum[n] = d.clone()
        step = torch._foreach_mul([self.momentum[n] for n in names], self.mu)
        torch._foreach_add_(step, deltas)
        torch._foreach_mul_(step, self.lr)
        return torch._foreach_sub(refs, step)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The outer state for a checkpoint (empty for K-AVG and before the first round)."""
        return {f"{STATE_PREFIX}{n}": m for n, m in self.momentum.items()}

    def ref_tensors(self) -> dict[str, torch.Tensor]:
        """The round-start snapshot (θ_global of the last sync), for a handover between two
        syncs (`engine.local_sgd_epoch`): at a sync point it equals the live values, so a sync
        checkpoint needs none."""
        return {f"{REF_PREFIX}{n}": t for n, t in self.ref.items()}

    def load_ref_tensors(self, tensors: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
        """Install the round-start snapshot from `ref_tensors` (after `start`, which took the live
        values); nothing where `tensors` holds none."""
        ref = {n.removeprefix(REF_PREFIX): t.to(device) if device is not None else t.clone()
               for n, t in tensors.items() if n.startswith(REF_PREFIX)}
        if ref:
            self.ref = ref

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
        """Install state from `state_tensors` (other names are ignored)."""
        self.momentum = {n.removeprefix(STATE_PREFIX): t.to(device) if device is not None else t.clone()
                         for n, t in tensors.items() if n.startswith(STATE_PREFIX)}

"""Pre-starting the next epoch's workers (Hydrozoa Sec. 4.3), and what it hid.

Cold starts of serverless containers take seconds (processes) to minutes (GPU containers).
The coordinator measures each worker's start-up latency (launch to the worker's first
step) and, while epoch e runs, launches epoch e+1's workers early enough that they are
ready when e ends, but no earlier, since a ready worker that waits is billed.

Model. Let s_1..s_n be measured start-up latencies (a prior s_0 when none yet), T the
epoch's predicted length, t the time elapsed in it and p its measured progress (0..1).
The remaining time is estimated from progress when there is any, R = t (1 - p) / p, else
R = T - t. Start-up is estimated by a high quantile of the samples, S = q_alpha(s), so a
slow start is still covered. Launch when R <= S + m (m a safety margin): the delay from
now is max(0, R - S - m).

Report. For a worker launched at L, ready at W (its first step), whose epoch could start
at E (the previous epoch's end; its own launch when nothing ran before), start-up W - L
splits into hidden = |[L, W] ∩ [L, E]| = max(0, min(W, E) - L) and exposed =
max(0, W - max(L, E)); a worker ready before E waits idle = max(0, E - W), billed but
useless. The epoch's critical exposed time is the largest exposed among its workers:
the epoch cannot start its first sync before its slowest worker.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from core.errors import ZooidValueError


class PrestartError(ZooidValueError):
    """Invalid input to the pre-start model (names the parameter)."""


def _nonneg(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise PrestartError(name, f"must be a finite number >= 0, got {value!r}")
    return float(value)


def startup_estimate(samples: Sequence[float], prior_s: float = 0.0, quantile: float = 0.9) -> float:
    """The start-up latency to plan for: the `quantile` of the measured samples, or `prior_s`
    when there are none (e.g. the target's configured `startup_s`)."""
    prior_s = _nonneg("prior_s", prior_s)
    if not 0.0 < quantile <= 1.0:
        raise PrestartError("quantile", f"must lie in (0, 1], got {quantile!r}")
    values = [_nonneg("samples", s) for s in samples]
    if not values:
        return prior_s
    return float(np.quantile(np.asarray(values), quantile, method="higher"))


def remaining_epoch_s(elapsed_s: float, predicted_epoch_s: float, progress: float | None = None) -> float:
    """Seconds left in the current epoch: extrapolated from `progress` (steps done / steps) when
    there is any, else the prediction minus what has elapsed."""
    elapsed_s = _nonneg("elapsed_s", elapsed_s)
    predicted_epoch_s = _nonneg("predicted_epoch_s", predicted_epoch_s)
    if progress is not None:
        if not (math.isfinite(progress) and 0.0 <= progress <= 1.0):
            raise PrestartError("progress", f"must lie in [0, 1], got {progress!r}")
        if progress > 0.0:
            return elapsed_s * (1.0 - progress) / progress
    return max(0.0, predicted_epoch_s - elapsed_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrestartDecision:
    """When to launch the next epoch's workers."""

    launch_in_s: float
    """Seconds from now; 0 means launch now."""
    remaining_s: float
    """Estimated seconds left in the current epoch."""
    startup_s: float
    """Start-up latency planned for."""

    @property
    def launch_now(self) -> bool:
        """Whether the workers should be launched at this check."""
        return self.launch_in_s <= 0.0


def decide_prestart(*, elapsed_s: float, predicted_epoch_s: float, startup_samples: Sequence[float],
                    progress: float | None = None, prior_startup_s: float = 0.0, margin_s: float = 1.0,
                    quantile: float = 0.9) -> PrestartDecision:
    """When to launch epoch e+1's workers, at a check `elapsed_s` into epoch e."""
    margin_s = _nonneg("margin_s", margin_s)
    remaining = remaining_epoch_s(elapsed_s, predicted_epoch_s, progress)
    startup = startup_estimate(startup_samples, prior_startup_s, quantile)
    return PrestartDecision(launch_in_s=max(0.0, remaining - startup - margin_s), remaining_s=remaining,
                            startup_s=startup)


@dataclass(frozen=True, kw_only=True, slots=True)
class StartupSplit:
    """Start-up time of one epoch's workers, hidden behind the previous epoch or exposed."""

    hidden_s: float
    """Worker-seconds of start-up that overlapped the previous epoch."""
    exposed_s: float
    """Worker-seconds of start-up after the previous epoch ended."""
    idle_s: float
    """Worker-seconds ready but waiting for the previous epoch to end (billed, unused)."""
    critical_exposed_s: float
    """The largest exposed start-up of one worker: what the epoch itself waited."""

    def to_dict(self) -> dict[str, float]:
        return {"hidden_s": self.hidden_s, "exposed_s": self.exposed_s, "idle_s": self.idle_s,
                "critical_exposed_s": self.critical_exposed_s}


def startup_split(workers: Iterable[tuple[float, float]], previous_end: float | None) -> StartupSplit:
    """Split each worker's (launched, ready) start-up around `previous_end` (None: no previous
    epoch, so everything is exposed)."""
    hidden = exposed = idle = critical = 0.0
    for launched, ready in workers:
        if not (math.isfinite(launched) and math.isfinite(ready)) or ready < launched:
            raise PrestartError("workers", f"need finite launched <= ready, got ({launched!r}, {ready!r})")
        end = launched if previous_end is None else previous_end
        h = max(0.0, min(ready, end) - launched)
        x = max(0.0, ready - max(launched, end))
        hidden, exposed, idle, critical = hidden + h, exposed + x, idle + max(0.0, end - ready), max(critical, x)
    return StartupSplit(hidden_s=hidden, exposed_s=exposed, idle_s=idle, critical_exposed_s=critical)

"""How much of the provider's notice a spot worker keeps working through.

A spot worker gets SIGTERM `notice_s` seconds before the SIGKILL (`prices.json`: Fargate Spot
120 s, ACI Spot and a Kubernetes spot node pool 30 s). Leaving at once would make its peers wait
for a replacement's whole start-up; instead a warm worker keeps working while its pool starts
its successor, and leaves when the pool releases it (the successor is ready) or when only the
margin is left: enough to write its handover and exit before the SIGKILL. One place for the
worker that acts on it (`engine.preemption`) and the planner that prices it (`planners.spot`).
"""
from __future__ import annotations

HANDOVER_MARGIN_S = 5.0
"""The least time kept, at the end of a notice, for the handover and the exit."""
HANDOVER_MARGIN_SHARE = 0.25
"""The share of a longer notice kept for them (a larger model's handover takes longer to write)."""


def work_through_s(notice_s: float) -> float:
    """Seconds after the notice a worker may keep working before it must hand over: the notice
    less its margin, `max(HANDOVER_MARGIN_S, HANDOVER_MARGIN_SHARE x notice_s)`; 0 (hand over
    at once) for a notice no longer than the margin."""
    notice_s = max(0.0, float(notice_s or 0.0))
    return max(0.0, notice_s - max(HANDOVER_MARGIN_S, HANDOVER_MARGIN_SHARE * notice_s))


"""How much of the provider's notice a spot worker keeps working through.

A spot worker gets SIGTERM `notice_s` seconds before the SIGKILL (`prices.json`: Fargate Spot
120 s, ACI Spot and a Kubernetes spot node pool 30 s). Leaving at once would make its peers wait
for a replacement's whole start-up; instead a warm worker keeps working while its pool starts
its successor, and leaves when the pool releases it (the successor is ready) or when only the
margin is left: enough to write its handover and exit before the SIGKILL. One place for the
worker that acts on it (`engine.preemption`) and the planner that prices it (`planners.spot`).
"""
from __future__ import annotations

import os
import time

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


# --- a notice kept while the worker starts (`runtime.notice_relay`) ----------------------------

NOTICE_DIR_VAR = "ZOOID_NOTICE_DIR"
"""The environment variable naming the relay's directory (set for the worker it runs only)."""
READY = "ready"
"""The file the worker writes there once it can take the notice (`ready_for_notice`)."""
NOTICED_AT = "noticed_at"
"""The file the relay writes there when it keeps a notice: the Unix time it came."""


def ready_for_notice() -> None:
    """Say to the relay, if the worker runs under one, that it can take the notice now: a kept
    notice is passed on, and later ones come as they come."""
    directory = os.environ.get(NOTICE_DIR_VAR)
    if directory and not os.path.exists(os.path.join(directory, READY)):
        try:
            with open(os.path.join(directory, READY), "w"):
                pass
        except OSError:  # the relay is gone: nothing kept for it to pass on
            pass


def take_relayed_notice() -> float | None:
    """The Unix time of the notice the relay kept while the worker started, once (the file is
    removed: a later notice comes as it comes), or None (no relay, or none kept)."""
    directory = os.environ.get(NOTICE_DIR_VAR)
    if not directory:
        return None
    path = os.path.join(directory, NOTICED_AT)
    try:
        with open(path) as f:
            at = float(f.read())
        os.unlink(path)
    except (OSError, ValueError):
        return None
    return at if 0 < at <= time.time() else None

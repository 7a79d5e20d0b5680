"""How a wait for a key polls the store: the schedule of `comm.store_base.Store.get` and the
slower one of control-plane waits (a warm worker's next command, the coordinator's replies:
`runtime.warm`, `coordinator.workers.warm_pool`), which the planner also counts
(`planners.store_requests.warm_channel_ops`). Each read is a billed request on a cloud store.
"""
from __future__ import annotations

POLL_GROWTH = 1.5
"""Each pause of a waiting `get` is this many times the one before (up to the store's poll_max_s):
start fast (a pipeline stage waits for its neighbour's activations), back off so that a long
wait costs few requests."""

CONTROL_POLL_SHARE = 0.02
"""A control-plane wait sees its key at most this share of the time it has waited late, once
past the store's own poll."""


def control_pause(pause: float, waited_s: float, poll_max_s: float, cap_s: float) -> float:
    """The sleep after `pause` in a control-plane wait that has lasted `waited_s`: the store's
    own schedule up to its `poll_max_s`, then `CONTROL_POLL_SHARE` of the time waited, at most
    `cap_s`; never shorter than `pause` (a wait that starts slower than the store polls stays so). A wait of T seconds past `poll_max_s / CONTROL_POLL_SHARE` costs about
    ln(T) / CONTROL_POLL_SHARE reads instead of T / poll_max_s, and is seen at most 2 % of T late."""
    grown = max(min(pause * POLL_GROWTH, max(poll_max_s, pause)), waited_s * CONTROL_POLL_SHARE)
    return min(grown, max(cap_s, poll_max_s))


def control_reads(wait_s: float, first_s: float, poll_max_s: float, cap_s: float) -> int:
    """The reads a control-plane wait of `wait_s` seconds makes on `control_pause`'s schedule
    from a first pause of `first_s` (one read before each pause; the one that finds the key
    after them is not counted)."""
    waited, pause, reads = 0.0, first_s, 0
    while waited < wait_s:
        reads += 1
        waited += pause
        pause = control_pause(pause, waited, poll_max_s, cap_s)
    return reads

"""How often the warm channel (`runtime.warm`, `coordinator.workers.warm_pool`) reads and writes
the durable store, from the job's lease and stall timeout: every request is billed on a cloud
store, so each is paced by what it is for. One place for the pool that runs the channel and the
planner that predicts its requests (`planners.store_requests.warm_channel_ops`).
"""
from __future__ import annotations

from dataclasses import dataclass

REPLY_POLL_S = 0.005
"""The coordinator's fastest pace of reading the replies (a store's own poll where slower: a
reply waits half of it on average, where a directory store's read of a missing key costs ~8 us)."""
REPLY_POLL_CAP_S = 1.0
"""The longest pause between two of the coordinator's reads of the replies (`control_pause`)."""


@dataclass(frozen=True)
class WarmCadence:
    """The channel's periods for a job's `worker_lease_s` and `worker_timeout_s`."""

    lease_s: float = 60.0
    timeout_s: float = 900.0

    @property
    def renew_s(self) -> float:
        """The coordinator renews the lease four times per lease (a put)."""
        return max(0.2, self.lease_s / 4)

    @property
    def check_s(self) -> float:
        """A worker reads the lease eight times per lease, at most every 10 s (a get)."""
        return min(10.0, self.lease_s / 8)

    @property
    def progress_s(self) -> float:
        """A busy worker writes its progress (a put) every sixtieth of the stall timeout, at most
        every 15 s and at least every second (or quarter of that timeout)."""
        return min(15.0, max(self.timeout_s / 60, min(1.0, self.timeout_s / 4)))

    @property
    def status_every_s(self) -> float:
        """The coordinator reads a busy worker's status (a get) twice per progress write."""
        return self.progress_s / 2

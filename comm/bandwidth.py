"""Emulated links and transfer accounting for store clients.

A serverless worker talks to its store over a link of fixed bandwidth (about 70 MB/s for
an AWS Lambda function). On one machine's loopback every transfer is nearly free, which
hides exactly the effect pipelined transfers are meant to exploit. `TokenBucket` paces
one direction of one client's link; `Link` holds an independent bucket per direction, so
an upload never slows a concurrent download (as on a full-duplex NIC).

`TransferStats` counts bytes and seconds per direction on every store, emulated or not,
so workers can report how long they spent moving data; the collectives count a rank's
traffic in the same type.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass

from core.errors import ZooidValueError


class TokenBucket:
    """Tokens (bytes) accrue at `rate` per second up to `burst`; a transfer spends them.

    `reserve(n)` spends `n` tokens at once, letting the balance go negative, and returns
    the monotonic time at which the balance is back to zero: the moment the transfer
    would have finished on the emulated link. Callers do their real I/O first and then
    sleep until that moment, so real and emulated time overlap instead of adding up.
    Concurrent transfers on one bucket queue behind each other, sharing the rate.
    """

    def __init__(self, rate: float, burst: float | None = None):
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ZooidValueError("bytes_per_s", f"must be a positive number, got {rate!r}")
        # A small default burst: large enough that tiny control messages are not
        # delayed by a quantum, small enough that a 1 MB transfer is paced.
        burst = float(min(64 * 1024, rate * 0.01)) if burst is None else float(burst)
        if not (math.isfinite(burst) and burst >= 0):
            raise ZooidValueError("burst", f"must be a non-negative number, got {burst!r}")
        self.rate = float(rate)
        self.burst = burst
        self._tokens = burst
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Spend `nbytes` tokens; return the monotonic deadline the transfer ends at."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= nbytes
            return now + max(0.0, -self._tokens / self.rate)

    def consume(self, nbytes: int) -> None:
        """Block until `nbytes` could have crossed the emulated link."""
        sleep_until(self.reserve(nbytes))


def sleep_until(deadline: float) -> None:
    """Sleep until the monotonic clock reaches `deadline` (no-op if it already has)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


@dataclass
class TransferStats:
    """Bytes a client moved and seconds it spent, per direction. A store's link counts its
    transfers and waits (`Store.stats`); a rank's collectives (`comm.collectives`) count
    their puts and gets, the calls made and the wall time spent in them."""

    bytes_up: int = 0
    bytes_down: int = 0
    upload_s: float = 0.0
    """Seconds spent uploading (a link's paced transfers, a collective's puts)."""
    download_s: float = 0.0
    """Seconds spent downloading (a link's paced transfers, a collective's gets)."""
    seconds_waiting: float = 0.0
    """Time `get` spent waiting for a key that was not there yet (not transfer time)."""
    seconds: float = 0.0
    """Wall time spent inside collective calls (transfers, waits and reductions)."""
    calls: int = 0
    """Collective calls made."""
    reposts: int = 0
    """Keys posted again because the store had lost them."""

    @property
    def bytes_total(self) -> int:
        """Bytes uploaded plus downloaded."""
        return self.bytes_up + self.bytes_down

    def to_dict(self) -> dict[str, float]:
        """JSON-able copy (workers report it as metrics)."""
        return asdict(self)

    def copy(self) -> "TransferStats":
        """A snapshot that later transfers do not change."""
        return TransferStats(**asdict(self))

    def __sub__(self, other: "TransferStats") -> "TransferStats":
        """What happened between two snapshots: `after - before`."""
        return TransferStats(**{k: v - getattr(other, k) for k, v in asdict(self).items()})


class Link:
    """One client's emulated link: optional upload and download buckets, plus the stats."""

    def __init__(self, upload_bytes_per_s: float | None = None,
                 download_bytes_per_s: float | None = None):
        self.up = None if upload_bytes_per_s is None else TokenBucket(upload_bytes_per_s)
        self.down = None if download_bytes_per_s is None else TokenBucket(download_bytes_per_s)
        self.stats = TransferStats()
        self._lock = threading.Lock()

    def upload(self, nbytes: int, transfer) -> None:
        """Run `transfer()` (the real upload of `nbytes`) paced and counted as upload."""
        start = time.monotonic()
        deadline = self.up.reserve(nbytes) if self.up else start
        transfer()
        sleep_until(deadline)
        with self._lock:
            self.stats.bytes_up += nbytes
            self.stats.upload_s += time.monotonic() - start

    def download(self, start: float, nbytes: int) -> None:
        """Pace and count a download of `nbytes` whose real transfer began at `start`.

        The size of a download is known only once it has arrived, so the bucket is
        charged afterwards; the deadline is measured from `start` all the same.
        """
        if self.down:
            # Charge as if reserved at `start`: the real transfer time counts toward it.
            deadline = self.down.reserve(nbytes)
            sleep_until(deadline - (time.monotonic() - start))
        with self._lock:
            self.stats.bytes_down += nbytes
            self.stats.download_s += time.monotonic() - start

    def waited(self, seconds: float) -> None:
        """Count time spent waiting for a key to appear."""
        with self._lock:
            self.stats.seconds_waiting += seconds

"""The data-parallel sync of a plan in words, for the report and the dry run: the outer step
and the dtype when they are not K-AVG in float32 (a default job's text stays as it was), and
the bytes each sync moved (`Plan.sync_bytes` predicted, the epochs' `bytes_synced` measured)."""
from __future__ import annotations

import math

from core.kinds import Strategy
from core.outer_sync import is_default


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB"


def outer_sync_words(p: dict) -> str:
    """E.g. `outer optimizer nesterov, syncs in int8 (0.0837 MB of state per sync)`; empty for
    K-AVG in float32 or a single replica."""
    outer, dtype = p.get("outer_optimizer") or "average", p.get("sync_dtype") or "float32"
    if is_default(outer, dtype) or (p.get("data_parallel") or 1) <= 1:
        return ""
    words = f"outer optimizer {outer}, syncs in {dtype}"
    return words + (f" ({_mb(p['sync_bytes'])} of state per sync)" if p.get("sync_bytes") else "")


def syncs_per_epoch(p: dict) -> int:
    """Data-parallel syncs per epoch: Local-SGD's rounds, or a hybrid's one per step."""
    steps = int(p.get("steps_per_epoch") or 0)
    if p.get("strategy") != Strategy.LOCAL_SGD:
        return steps
    k = p.get("sync_period")
    return 1 if not k else max(1, math.ceil(steps / k))


def measured_bytes_per_sync(p: dict, epochs: list) -> float | None:
    """Bytes one replica moved (up and down) per sync, over the epochs run; None if none synced."""
    stages = int(p.get("stages") or 1)
    syncs = sum(e.workers // stages * syncs_per_epoch(p) for e in epochs if e.workers // stages > 1)
    moved = sum(e.bytes_synced for e in epochs)
    return moved / syncs if syncs and moved else None


def outer_sync_row(p: dict, epochs: list) -> list[tuple[str, str]]:
    """The report's `outer sync` row, or none for K-AVG in float32."""
    words = outer_sync_words(p)
    if not words:
        return []
    measured = measured_bytes_per_sync(p, epochs)
    return [("outer sync", words + (f"; {_mb(measured)} moved per replica per sync (measured)" if measured else ""))]

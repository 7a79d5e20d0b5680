"""Per-epoch wall, busy and overhead from a run's summary (`EpochSummary` rows): wall = the
epoch's `seconds` (the coordinator's clock, from sending the epoch's work to the last reply);
busy = `critical_busy_s`, the slowest worker's compute + sync; overhead = wall - busy."""
from __future__ import annotations

from benchmarks.harness.tables import median

DETAIL = "more workers than cores wait for CPU, which lands in both busy and overhead"
"""The machine line's note for results built on these figures."""


def busy_s(e: dict) -> float:
    """The slowest worker's compute + sync seconds of epoch summary `e` (`compute_s + sync_s`,
    the maxima over workers, where a summary lacks `critical_busy_s`)."""
    b = e.get("critical_busy_s")
    if b is None:
        if e.get("compute_s") is None or e.get("sync_s") is None:
            raise RuntimeError(f"epoch {e.get('epoch')}: the summary has neither critical_busy_s nor compute_s/sync_s")
        b = float(e["compute_s"]) + float(e["sync_s"])
    return float(b)


def epoch_rows(target: str, mode: str, summary: dict) -> list[dict]:
    """One row per epoch of a run: wall, busy, overhead, share, and (warm) how many of the
    epoch's worker processes were not there the epoch before."""
    rows, before = [], None
    for e in sorted(summary["epochs"], key=lambda e: e["epoch"]):
        wall, busy = float(e["seconds"]), busy_s(e)
        pids = set((e.get("worker_pids") or {}).values()) - {None}
        new = (len(pids - before) if before is not None else len(pids)) if pids else None
        before = pids if pids else None
        rows.append({"target": target, "mode": mode, "workers": e["workers"], "epoch": e["epoch"],
                     "wall_s": wall, "busy_s": busy, "overhead_s": wall - busy,
                     "share": (wall - busy) / wall if wall > 0 else float("nan"),
                     "new_procs": new, "val_accuracy": e.get("val_accuracy")})
    return rows


def summarise_rows(rows: list[dict]) -> dict:
    """Epoch 0's overhead, and medians over epochs 1.. (None where the run had one epoch)."""
    first = [r for r in rows if r["epoch"] == 0]
    later = [r for r in rows if r["epoch"] >= 1]
    return {"epoch0_overhead_s": first[0]["overhead_s"] if first else None,
            "epoch0_wall_s": first[0]["wall_s"] if first else None,
            "overhead_s": median(r["overhead_s"] for r in later), "wall_s": median(r["wall_s"] for r in later),
            "share": median(r["share"] for r in later), "epochs_after_first": len(later)}

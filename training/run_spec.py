"""Run one WorkerSpec with the engine its strategy needs (Local-SGD replica or pipeline stage)."""
from __future__ import annotations

from training.errors import ZooidValueError
from training.specs import WorkerResult, WorkerSpec
from training.store import Store


def run_spec(spec: WorkerSpec, store: Store) -> WorkerResult:
    """Dispatch on `spec.extra["strategy"]` (default `local_sgd`)."""
    if chaos_requested(spec) == "crash_worker":
        import os

        os._exit(17)  # an injected crash: no cleanup, no result, like a killed container
    strategy = spec.extra.get("strategy", "local_sgd")
    if strategy == "local_sgd":
        from training.local_sgd import run_local_sgd_epoch

        return run_local_sgd_epoch(spec, store)
    if strategy in ("pipeline", "hybrid"):
        from training.pipeline_executor import run_pipeline_worker

        return run_pipeline_worker(spec, store)
    raise ZooidValueError("strategy", f"unknown worker strategy {strategy!r}")


def chaos_requested(spec: WorkerSpec) -> str | None:
    """The fault `ZOOID_CHAOS` asks of this worker, if any: `crash_worker:epoch=E:rank=R`
    (`attempt=A` optional; without it every attempt crashes). Off unless the variable is set."""
    import os

    text = os.environ.get("ZOOID_CHAOS", "")
    for item in filter(None, text.split(",")):
        kind, *conds = item.split(":")
        want = dict(c.split("=", 1) for c in conds)
        if all(str(getattr(spec, k)) == v for k, v in want.items() if k in ("epoch", "rank", "attempt")):
            return kind
    return None

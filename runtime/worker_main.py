"""`python -m runtime.worker_main --spec-json '<json>'`: run one worker as a process.

The spec picks the engine (`runtime.run_spec`: a pipeline stage worker when `stage` is set,
else a Local-SGD replica). The `inline` target starts workers this way. The last
line on stdout is JSON: the WorkerResult (`WorkerResult.from_dict` reads it back), or on
failure `{"error": <class name>, "message": ...}` with a non-zero exit status: 2 for bad
input (ZooidValueError), 3 for a store timeout, 4 for out-of-memory (OutOfMemory or a
MemoryError), 5 for a warm worker whose lease expired, 6 for a worker that got the provider's
notice and left (`Preempted`, `engine.preemption`; also a notice outside an epoch, where the
worker leaves at once: `engine.preemption.leaving`), 7 for data the store holds unreadable
(`DataError`: a shard missing or corrupt after its reads), 1 for anything else.

A spec with `warm` set starts a warm worker (`runtime.warm`): it serves the run's
epochs from the store until the coordinator stops it or its lease expires, and prints its
log lines; it exits 0 when stopped. `coordinator.workers.failures.classify_failure` reads these back.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from comm.store import Store, open_store
from core.errors import DataError, LeaseExpired, OutOfMemory, Preempted, StoreTimeout, ZooidValueError
from core.fast_exit import exit_now
from core.specs import WorkerSpec
from engine import preemption
from engine.optimizers import load_lazy_modules
from runtime.run_spec import run_spec
from runtime.warm import serve

EXIT_CODES = ((ZooidValueError, 2), (StoreTimeout, 3), (OutOfMemory, 4), (MemoryError, 4), (LeaseExpired, 5),
              (Preempted, 6), (DataError, 7))


def _run_job(spec: WorkerSpec, warm_store, open_ref=open_store):
    """One epoch of a warm worker: on its command store, or another one the spec names."""
    if spec.store_url == warm_store.url:
        return run_spec(spec, warm_store, open_ref)
    store = open_ref(spec.store_url)
    try:
        return run_spec(spec, store, open_ref)
    finally:
        store.close()


def main(argv: list[str] | None = None, open_ref: Callable[[str], Store] = open_store) -> int:
    """Parse the spec, run the worker, print the result JSON; return the exit status.
    `open_ref` opens the spec's stores (`flows.worker.main` passes one that loads store
    blocks from the Prefect API; here, URLs only)."""
    parser = argparse.ArgumentParser(prog="python -m runtime.worker_main", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec-json", help="the WorkerSpec as a JSON object")
    source.add_argument("--spec-file", help="a file holding the WorkerSpec JSON")
    args = parser.parse_args(argv)
    # the provider's notice from here on: an epoch hands over, anywhere else the worker leaves at once
    with preemption.leaving():
        return _main(args, open_ref)


def _main(args: argparse.Namespace, open_ref: Callable[[str], Store]) -> int:
    """`main` once its arguments are parsed, under the notice handler."""
    load_lazy_modules()  # part of the start-up, not of the first epoch
    try:
        text = args.spec_json if args.spec_json is not None else open(args.spec_file).read()
        try:
            spec = WorkerSpec.from_dict(json.loads(text))
        except (json.JSONDecodeError, TypeError) as exc:
            raise ZooidValueError("spec", f"not a WorkerSpec JSON object: {exc}") from None
        store = open_ref(spec.store_url)
        try:
            if spec.warm is not None:
                serve(spec, store, lambda job: _run_job(job, store, open_ref), lambda: open_ref(spec.store_url),
                      log=lambda line: print(line, flush=True), open_ref=open_ref)
                return 0
            result = run_spec(spec, store, open_ref)
        finally:
            store.close()
    except Exception as exc:  # reported as data on the last line, for the coordinator
        code = next((c for cls, c in EXIT_CODES if isinstance(exc, cls)), 1)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return code
    print(json.dumps(result.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    exit_now(main())

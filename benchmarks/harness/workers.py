"""Instrumented worker processes: one WorkerSpec each (a Local-SGD replica or a pipeline stage),
run by `runtime.run_spec` with the engine's loop points wrapped to stamp their start and end.

A script runs them with `run_workers(specs, folder, module)`; each process is
`python -m <module> --worker SPEC --out JSON`, whose `--worker` entry calls `worker_main` (with
its own probes, e.g. a memory counter). One clock for every process (CLOCK_MONOTONIC on Linux),
so the stamps of stages compare.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.home import REPO
from engine.iteration_clock import WARMUP

WARMUP_ITERATIONS = WARMUP
"""Iterations a measurement leaves out at the start, as the workers' own clocks do."""


def _now() -> float:
    # CLOCK_MONOTONIC on Linux: one clock for every process, so stages' stamps compare.
    return time.perf_counter()


def one_thread_env() -> dict[str, str]:
    """This process's environment with one OpenMP/MKL thread, as workers run, and the
    repository importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def install_timers(t: dict) -> None:
    """Wrap the engine's loop points to append (start, end) stamps to the lists in `t`:
    `steps` (Local-SGD: compute end, sync end), `ckpt` (Local-SGD's sync checkpoint writes,
    inside the sync), `iterations`, `F`, `B`, `sync`, `put`, `read` (the read that found an
    activation's key) and `fetch` (a download thread's whole get: waiting, reading,
    deleting, decoding) of a pipeline stage worker, the last three with their keys. Only
    the benchmarks' worker processes call this."""
    import torch

    from engine import local_sgd, local_sgd_epoch, pipeline_stage_worker

    for name in ("steps", "ckpt", "iterations", "F", "B", "sync", "put", "read", "fetch"):
        t.setdefault(name, [])
    inside = [False]  # validation forwards and the checkpoint are not iterations

    after_step = local_sgd.LocalSGD.after_step

    def timed_after_step(self):
        t0 = _now()
        after_step(self)
        t["steps"].append((t0, _now()))

    local_sgd.LocalSGD.after_step = timed_after_step
    save_checkpoint = local_sgd_epoch.save_checkpoint

    def timed_save_checkpoint(*args, **kwargs):
        t0 = _now()
        written = save_checkpoint(*args, **kwargs)
        t["ckpt"].append((t0, _now()))
        return written

    local_sgd_epoch.save_checkpoint = timed_save_checkpoint  # the sync checkpoint rank 0 writes

    worker = pipeline_stage_worker.StageWorker
    init, iteration, sync, put = worker.__init__, worker._iteration, worker._sync_gradients, worker._put
    fetch = worker._fetch

    def timed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        began = [0.0]

        def forward_began(*_):
            began[0] = _now()

        def forward_ended(*_):
            if inside[0]:
                t["F"].append((began[0], _now()))

        self.module.register_forward_pre_hook(forward_began)
        self.module.register_forward_hook(forward_ended)
        store_type, read = type(self.store), type(self.store)._read

        def timed_read(store, key):
            t0 = _now()
            data = read(store, key)
            if data is not None and "/act/" in key:
                t["read"].append((t0, _now(), len(data), key))
            return data

        store_type._read = timed_read

    def timed_iteration(self, *args, **kwargs):
        inside[0], t0 = True, _now()
        try:
            return iteration(self, *args, **kwargs)
        finally:
            inside[0] = False
            t["iterations"].append((t0, _now()))

    def timed_sync(self, *args, **kwargs):
        t0 = _now()
        sync(self, *args, **kwargs)
        t["sync"].append((t0, _now()))

    def timed_put(self, key, tensor):
        t0 = _now()
        put(self, key, tensor)
        t["put"].append((t0, _now(), tensor.numel() * tensor.element_size(), key))

    def timed_fetch(self, key):
        t0 = _now()
        tensor = fetch(self, key)
        if inside[0]:
            t["fetch"].append((t0, _now(), key))
        return tensor

    worker.__init__, worker._iteration, worker._fetch = timed_init, timed_iteration, timed_fetch
    worker._sync_gradients, worker._put = timed_sync, timed_put

    backward = torch.Tensor.backward

    def timed_backward(self, *args, **kwargs):
        t0 = _now()
        backward(self, *args, **kwargs)
        if inside[0]:
            t["B"].append((t0, _now()))

    torch.Tensor.backward = timed_backward


def worker_main(spec_path: str, out_path: str, probes: dict | None = None) -> None:
    """Run one WorkerSpec (Local-SGD replica or pipeline stage) with timers, and each of
    `probes` (name -> installer filling a dict, e.g. a memory counter); write JSON."""
    import torch

    from comm.store import open_store
    from core.specs import WorkerSpec
    from runtime.run_spec import run_spec

    torch.set_num_threads(1)
    timings: dict = {}
    install_timers(timings)
    measured = {name: {} for name in probes or {}}
    for name, install in (probes or {}).items():  # outside the timers: their bookkeeping is not stamped
        install(measured[name])
    spec = WorkerSpec.from_dict(json.loads(Path(spec_path).read_text()))
    store = open_store(spec.store_url)
    try:
        result = run_spec(spec, store)
    finally:
        store.close()
    Path(out_path).write_text(json.dumps({"result": result.to_dict(), "timings": timings, **measured}))


def run_workers(specs, scratch: Path, module: str, timeout_s: float = 300.0) -> list[dict]:
    """Start one worker process per spec (own process group, one torch thread), wait for all;
    return each one's {"result", "timings"} in spec order. A failure stops the others.
    `module` is the entry point each runs (`python -m <module> --worker SPEC --out JSON`)."""
    env = one_thread_env()
    procs, outs = [], []
    for i, spec in enumerate(specs):
        spec_file, out_file = scratch / f"spec-{i}.json", scratch / f"out-{i}.json"
        spec_file.write_text(json.dumps(spec.to_dict()))
        out_file.unlink(missing_ok=True)
        log = open(scratch / f"worker-{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, "--worker", str(spec_file),
             "--out", str(out_file)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        outs.append(out_file)
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = (scratch / f"worker-{bad[0]}.log").read_text()[-1500:]
        raise RuntimeError(f"worker {bad[0]} exited {procs[bad[0]].returncode}:\n{tail}")
    return [json.loads(o.read_text()) for o in outs]

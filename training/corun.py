"""How much a worker's compute slows when another worker computes beside it on one machine.

The `inline` and local `process` targets run every worker process of a plan on the same
machine. One core per process is not one machine per process: the processes share the
last-level cache and the memory bandwidth, so a training step that runs alone at t runs
at about `factor` x t while a second process trains beside it (measured here, 2 cores:
a vgg11-shaped model's step 20-30 % slower, digits_cnn's 30 %; the model without this term
predicted two-worker plans 10-45 % low while one-worker plans came within a few %).

`measure_corun` starts `processes` real worker processes (one torch thread each, the
allocator pinned, as workers run), has each build the job's model and run its training
step, and times the step in rounds: rank 0 alone, then every rank at once, alternately,
each round at least `min_seconds` long. The factor is the median step of a rank while all
ran over the median of the same rank alone, the median over ranks. Processes run in their
own process group and are stopped by pid on any failure; a rank whose parent dies reads the
end of its stdin and exits. Nothing is read from a store.

    python -m training.corun '<config json>'     # one rank: the parent drives it over stdin
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from training.subprocess_env import one_thread_env


@dataclass(frozen=True)
class CoRun:
    """Step seconds of one worker process alone and beside `processes - 1` others, and the
    seconds of one tensor's trip through a store back to back with nothing else running
    (as the profile times puts and gets) and as a stage makes it, after a pause, with every
    process computing (None: not measured)."""

    processes: int
    alone_s: float
    together_s: float
    transfer_tight_s: float | None = None
    transfer_busy_s: float | None = None

    @property
    def factor(self) -> float:
        """Slowdown of a step while the others compute (at least 1: below it is noise)."""
        return max(1.0, self.together_s / self.alone_s)

    @property
    def transfer_extra_s(self) -> float:
        """Seconds a put, and a get, cost beyond the back-to-back timing when the transfer
        thread wakes from a pause while the machine computes: half the trips' difference
        (each trip is a put and a get, each woken on its own thread in a stage); 0 when not
        measured."""
        if self.transfer_tight_s is None or self.transfer_busy_s is None:
            return 0.0
        return max(0.0, self.transfer_busy_s - self.transfer_tight_s) / 2

    def to_dict(self) -> dict:
        return {"processes": self.processes, "alone_s": self.alone_s, "together_s": self.together_s,
                "factor": self.factor, "transfer_tight_s": self.transfer_tight_s,
                "transfer_busy_s": self.transfer_busy_s, "transfer_extra_s": self.transfer_extra_s}


def measure_corun(model: str, input_shape: tuple[int, ...], classes: int, batch_size: int, *,
                  model_kwargs: dict | None = None, optimizer: str = "sgd", processes: int = 2,
                  rounds: int = 3, min_seconds: float = 0.3, seed: int = 0, transfer_bytes: int = 0,
                  timeout_s: float = 300.0) -> CoRun:
    """Time `model`'s training step at `batch_size` in one process alone and in `processes`
    processes at once (see the module docstring). With `transfer_bytes`, rank 0 also
    times a transfer thread's trips of a tensor of that size (put, get, delete, decode,
    through a directory store of its own): back to back with nothing else running, and
    after a pause of 1-3 ms each (a stage's transfers come between its computations, and
    each wakes its thread) while every rank computes, its own main thread included."""
    if processes < 2:
        raise ValueError(f"processes: {processes}; the co-run slowdown needs at least 2")
    if batch_size < 1:
        raise ValueError(f"batch_size: {batch_size}; must be at least 1")
    config = {"model": model, "input_shape": list(input_shape), "classes": classes, "batch_size": batch_size,
              "model_kwargs": model_kwargs or {}, "optimizer": optimizer, "seed": seed,
              "min_seconds": min_seconds, "transfer_bytes": int(transfer_bytes)}
    procs = [subprocess.Popen([sys.executable, "-m", "training.corun", json.dumps(config)], env=one_thread_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(processes)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            _expect(p, "ready", deadline)
        alone, together, tight_trips, busy_trips = [], [[] for _ in procs], [], []
        for _ in range(rounds):
            alone += _round(procs[:1], deadline)[0]["step"]
            for mine, got in zip(together, _round(procs, deadline)):
                mine += got["step"]
            if transfer_bytes:
                tight_trips += _round(procs[:1], deadline, "transfer")[0]["transfer"]
                busy_trips += _round(procs, deadline, "both")[0]["transfer"]
        for p in procs:
            p.stdin.write("stop\n")
            p.stdin.flush()
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            for stream in (p.stdin, p.stdout, p.stderr):
                stream.close()
    # rank 0 alone vs rank 0 together; the others are checked by being alike (same model)
    return CoRun(processes, statistics.median(alone), statistics.median(together[0]),
                 statistics.median(tight_trips) if tight_trips else None,
                 statistics.median(busy_trips) if busy_trips else None)


def _round(procs: list[subprocess.Popen], deadline: float, first: str = "step") -> list[dict]:
    """Run one round: rank 0 does `first` ("step", "transfer" or "both"), the others train;
    each one's {"step": seconds, "transfer": seconds}."""
    for i, p in enumerate(procs):
        p.stdin.write(f"{first if i == 0 else 'step'}\n")
        p.stdin.flush()
    return [json.loads(_expect(p, "times ", deadline)) for p in procs]


def _expect(p: subprocess.Popen, prefix: str, deadline: float) -> str:
    """The rest of the next line `p` prints, which must start with `prefix` (by `deadline`)."""
    # one line answers each request, so nothing waits in the reader's buffer: select sees it
    ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = p.stdout.readline() if ready else ""
    if not line.startswith(prefix):
        try:  # its stdout closed: it is exiting, so its last error is about to be complete
            p.wait(timeout=5.0)
            err = p.stderr.read()
        except subprocess.TimeoutExpired:
            err = ""  # still running: the caller stops it
        raise RuntimeError(f"co-run probe process failed (exit {p.poll()}): "
                           f"{(err.strip().splitlines() or [line.strip() or 'no answer'])[-1]}")
    return line[len(prefix):].strip()


def _rank(config: dict) -> None:
    """One probe process: build the model, warm its step up, then for each "go" line run the
    step for `min_seconds` and print its step times; exit on "stop"."""
    import torch

    from training.links import step_timer
    from training.malloc import pin_malloc_thresholds
    from training.models import build_model
    from training.optimizers import build_optimizer

    torch.set_num_threads(1)
    pin_malloc_thresholds()
    net = build_model(config["model"], config["seed"], **config["model_kwargs"])
    opt = build_optimizer(config["optimizer"], net, 1e-9)  # the weights barely move
    step = step_timer(net, opt, config, config["seed"])
    began = time.perf_counter()
    while time.perf_counter() - began < config["min_seconds"] / 2:  # warm-up, every rank at once
        step()
    print("ready", flush=True)
    scratch = tempfile.mkdtemp(prefix="zooid-corun-")
    try:
        for line in sys.stdin:
            what = line.strip()
            if what not in ("step", "transfer", "both"):
                break
            trips: list[float] = []
            stop = threading.Event()
            mover = threading.Thread(target=_transfer_trips, args=(scratch, config["transfer_bytes"], stop, trips,
                                                                   what == "both"))
            if what != "step":
                mover.start()
            times, began = [], time.perf_counter()
            while time.perf_counter() - began < config["min_seconds"] or (what != "transfer" and len(times) < 3):
                if what == "transfer":
                    time.sleep(0.01)
                else:
                    times.append(step())
            stop.set()
            if what != "step":
                mover.join()
            print("times " + json.dumps({"step": times, "transfer": trips}), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _transfer_trips(root: str, nbytes: int, stop: threading.Event, trips: list[float], pause: bool) -> None:
    """A transfer thread: a tensor of `nbytes` put, read back, deleted and decoded through a
    directory store at `root` (after a pause of 1-3 ms each time when `pause`), until
    `stop`; appends each trip's seconds."""
    import random

    import torch

    from training.store import open_store
    from training.tensor_codec import decode_tensors, encode_tensors

    store = open_store(Path(root).as_uri())
    tensor, rng = torch.randn(max(1, nbytes // 4)), random.Random(0)
    try:
        while not stop.is_set():
            if pause:
                time.sleep(rng.uniform(0.001, 0.003))
            t0 = time.perf_counter()
            store.put("t", encode_tensors({"t": tensor}), scratch=True)
            blob = store.get("t")
            store.delete("t")
            decode_tensors(blob)
            trips.append(time.perf_counter() - t0)
    finally:
        store.close()


if __name__ == "__main__":
    _rank(json.loads(sys.argv[1]))

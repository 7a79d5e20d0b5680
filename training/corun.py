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
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from training.subprocess_env import one_thread_env


@dataclass(frozen=True)
class CoRun:
    """Step seconds of one worker process alone and beside `processes - 1` others."""

    processes: int
    alone_s: float
    together_s: float

    @property
    def factor(self) -> float:
        """Slowdown of a step while the others compute (at least 1: below it is noise)."""
        return max(1.0, self.together_s / self.alone_s)

    def to_dict(self) -> dict:
        return {"processes": self.processes, "alone_s": self.alone_s, "together_s": self.together_s,
                "factor": self.factor}


def measure_corun(model: str, input_shape: tuple[int, ...], classes: int, batch_size: int, *,
                  model_kwargs: dict | None = None, optimizer: str = "sgd", processes: int = 2,
                  rounds: int = 3, min_seconds: float = 0.3, seed: int = 0,
                  timeout_s: float = 300.0) -> CoRun:
    """Time `model`'s training step at `batch_size` in one process alone and in `processes`
    processes at once (see the module docstring)."""
    if processes < 2:
        raise ValueError(f"processes: {processes}; the co-run slowdown needs at least 2")
    if batch_size < 1:
        raise ValueError(f"batch_size: {batch_size}; must be at least 1")
    config = {"model": model, "input_shape": list(input_shape), "classes": classes, "batch_size": batch_size,
              "model_kwargs": model_kwargs or {}, "optimizer": optimizer, "seed": seed,
              "min_seconds": min_seconds}
    procs = [subprocess.Popen([sys.executable, "-m", "training.corun", json.dumps(config)], env=one_thread_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(processes)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            _expect(p, "ready", deadline)
        alone, together = [], [[] for _ in procs]
        for _ in range(rounds):
            alone += _round(procs[:1], deadline)[0]
            for mine, got in zip(together, _round(procs, deadline)):
                mine += got
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
    return CoRun(processes, statistics.median(alone), statistics.median(together[0]))


def _round(procs: list[subprocess.Popen], deadline: float) -> list[list[float]]:
    """Tell `procs` to run their step for the round; each one's step seconds."""
    for p in procs:
        p.stdin.write("go\n")
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
    from torch import nn

    from training.malloc import pin_malloc_thresholds
    from training.models import build_model
    from training.optimizers import build_optimizer

    torch.set_num_threads(1)
    pin_malloc_thresholds()
    net = build_model(config["model"], config["seed"], **config["model_kwargs"])
    opt = build_optimizer(config["optimizer"], net, 1e-9)  # the weights barely move
    gen = torch.Generator().manual_seed(config["seed"])
    x = torch.randn(config["batch_size"], *config["input_shape"], generator=gen)
    y = torch.randint(0, config["classes"], (config["batch_size"],), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    began = time.perf_counter()
    while time.perf_counter() - began < config["min_seconds"] / 2:  # warm-up, every rank at once
        step()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        times, began = [], time.perf_counter()
        while time.perf_counter() - began < config["min_seconds"] or len(times) < 3:
            times.append(step())
        print("times " + json.dumps(times), flush=True)


if __name__ == "__main__":
    _rank(json.loads(sys.argv[1]))

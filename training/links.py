"""The link side of a profile: the store and the collectives the workers will sync through.

Not cached (a store's speed depends on where it runs):

- `profile_store`: the store's bandwidth and latency in the planners' contract form (one
  bandwidth, one latency per transfer), with the hand-off delay of a polling store
  (`measure_handoff`);
- `profile_transfers`: what a worker's transfer really costs, put (encode + upload) and get
  (download + decode) fitted apart, at sizes up to the tensors the job will move;
- `measure_contention`: FuncPipe's beta, compute slowdown while transfers run (Sec. 3.4.2);
- `time_store_collective`: the store allreduce timed among real worker processes, as the
  workers run it; `fit_scatter_reduce` fits the store collectives' sync model to it and
  `fit_allreduce_samples` the hybrid contract's alpha/beta.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from training.profiler import ANCHOR_MIN_S, _median_time

@dataclass(frozen=True)
class ContentionResult:
    """Median compute seconds alone and under transfer load, and the bytes moved meanwhile."""

    alone_s: float
    loaded_s: float
    bytes_moved: int

    @property
    def factor(self) -> float:
        """beta = loaded / alone, never below 1 (transfers do not speed compute up)."""
        return max(1.0, self.loaded_s / self.alone_s)



def _link(per_byte: float, latency: float) -> tuple[float, float]:
    """(bandwidth, latency) from a fitted slope and intercept: a slope of 0 or less (noise
    on a fast link) reads as 1 TB/s, and the latency is floored at 1 us (an emulated link's
    burst allowance can make the intercept slightly negative)."""
    return (1.0 / per_byte if per_byte > 0 else 1e12), max(latency, 1e-6)


def fit_store(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) from (bytes, seconds) transfers by least squares on
    seconds = bytes / bandwidth + latency; latency is floored at 1 us (an emulated link's
    burst allowance can make the intercept slightly negative)."""
    a = np.array([(size, 1.0) for size, _ in samples], dtype=float)
    coef, *_ = np.linalg.lstsq(a, np.array([s for _, s in samples], dtype=float), rcond=None)
    return _link(float(coef[0]), float(coef[1]))


def measure_handoff(store, run_prefix: str, repeats: int = 12, delay_s: float = 0.005) -> float:
    """Mean seconds between a put finishing and a reader already waiting in `get` seeing
    it: the notice delay of a store without notifications (a polling reader), which every
    worker-to-worker transfer pays once and a put-then-get probe never sees. The writer
    (a thread of this process) puts after `delay_s` plus a random part of a poll
    interval, so the put lands at a random phase of the reader's polls (a fixed delay
    lands at the same phase every time and reads anywhere between 0 and one interval);
    the mean is what a run pays on average. `time_store_collective` measures the same
    between two processes, as workers see it."""
    import random

    rng = random.Random(0)
    spread = _poll_interval(store)
    delays = []
    key_base = f"{run_prefix}/handoff-{uuid.uuid4().hex[:8]}"
    try:
        for i in range(repeats):
            key, done, wait = f"{key_base}/{i}", {}, delay_s + rng.uniform(0, spread)

            def writer():
                time.sleep(wait)
                store.put(key, b"x", scratch=True)
                done["at"] = time.perf_counter()

            t = threading.Thread(target=writer)
            t.start()
            store.get(key, timeout=10)
            seen = time.perf_counter()
            t.join()
            delays.append(max(0.0, seen - done.get("at", seen)))
    finally:
        store.delete_prefix(key_base)
    return statistics.fmean(delays)


def _poll_interval(store) -> float:
    """The longest pause of a waiting `get` between two reads of `store`."""
    return float(getattr(store, "poll_max_s", 0.002))


def profile_store(store, run_prefix: str, sizes: tuple[int, ...] = (1 << 10, 16 << 10, 64 << 10, 1 << 20, 4 << 20),
                  repeats: int = 3, handoff_s: float | None = None) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of `store`: every put and every get of `sizes` bytes
    is one transfer sample for `fit_store` (the small sizes pin the latency down). The
    latency also carries half the hand-off delay (`handoff_s`, measured by `measure_handoff`
    when None): the planners count a store transfer as an upload plus a download, each with
    one latency, while a waiting reader notices a new key once. Keys live under
    `run_prefix` and are deleted."""
    samples = []
    key_base = f"{run_prefix}/probe-{uuid.uuid4().hex[:8]}"
    try:
        for size in sizes:
            payload = np.random.default_rng(size).bytes(size)
            for i in range(repeats):
                key = f"{key_base}/{size}-{i}"
                t0 = time.perf_counter()
                store.put(key, payload, scratch=True)  # as a stage's activations
                t1 = time.perf_counter()
                store.get(key)
                samples += [(size, t1 - t0), (size, time.perf_counter() - t1)]
    finally:
        store.delete_prefix(key_base)
    bandwidth, latency = fit_store(samples)
    if handoff_s is None:
        handoff_s = measure_handoff(store, run_prefix)
    return bandwidth, latency + handoff_s / 2


def measure_contention(model: nn.Module, input_shape: tuple[int, ...], num_classes: int,
                       microbatch_size: int, store, run_prefix: str, *,
                       payload_bytes: int = 4 << 20, repeats: int = 5) -> ContentionResult:
    """Forward + backward of `model` on one micro-batch, timed alone and while a background
    thread uploads and downloads `payload_bytes` to `store` without pause (FuncPipe's
    beta: compute slows while a worker's transfers run). Each phase is a median over at
    least `ANCHOR_MIN_S` (five single calls varied the factor from 1.0 to 1.46 for one
    model); alone is timed before and after the loaded phase and averaged, so a drift in
    machine load does not pass for contention."""
    device = next(model.parameters(), torch.empty(0)).device
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(microbatch_size, *input_shape, generator=gen).to(device)
    y = torch.randint(0, num_classes, (microbatch_size,), generator=gen).to(device)
    loss_fn = nn.CrossEntropyLoss()

    def compute() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    def timed() -> float:
        # at least ANCHOR_MIN_S of samples: the factor is a ratio of two such medians
        return _median_time(compute, repeats, device, warmup=0, min_time_s=ANCHOR_MIN_S)

    key = f"{run_prefix}/contention-{uuid.uuid4().hex[:8]}"
    payload = np.random.default_rng(0).bytes(payload_bytes)
    stop, started, moved = threading.Event(), threading.Event(), [0]

    def transfer() -> None:
        while not stop.is_set():
            store.put(key, payload, scratch=True)
            store.get(key)
            moved[0] += 2 * payload_bytes
            started.set()

    saved_state = copy.deepcopy(model.state_dict())
    try:
        _median_time(compute, 1, device)  # warm-up
        alone = [timed()]
        worker = threading.Thread(target=transfer, name="contention-load", daemon=True)
        worker.start()
        try:
            started.wait(timeout=30)
            loaded = timed()
        finally:
            stop.set()
            worker.join()
        alone.append(timed())
    finally:
        model.load_state_dict(saved_state)
        model.zero_grad(set_to_none=True)
        store.delete_prefix(key)
    return ContentionResult(statistics.fmean(alone), loaded, moved[0])


def fit_allreduce_samples(samples: Sequence[tuple[int, int, float]],
                          bandwidth_bytes_per_s: float = float("inf")) -> tuple[float, float, float]:
    """(alpha s/byte, beta s, rmse s) of the hybrid contract's ring form
    T = 2 (A - 1) (P / (A bw) + alpha P / A + beta), by the planner's own least squares
    (`planners.hybrid.fit_allreduce`), so the fit and the planner share one model. With
    the store's bandwidth given, alpha is the per-byte cost beyond the link."""
    from planners.hybrid import fit_allreduce  # pure numpy; one definition of the model

    fit = fit_allreduce(samples, bandwidth_bytes_per_s)
    return fit.alpha_s_per_byte, fit.beta_s, fit.rmse_s


# --- what a worker's transfers and collectives really cost ------------------------------


@dataclass(frozen=True, kw_only=True)
class TransferProfile:
    """A worker's tensor transfers through the store, as the engine makes them: put =
    encode + upload, get = download + decode, each `latency + bytes / bandwidth`; handoff =
    how late a reader already waiting for a key notices it (a polling store)."""

    put_latency_s: float
    put_bandwidth: float
    get_latency_s: float
    get_bandwidth: float
    handoff_s: float

    def to_dict(self) -> dict:
        """Plain JSON-able dict."""
        return dataclasses.asdict(self)


def fit_endpoints(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of seconds = bytes / bandwidth + latency through the
    median seconds of the smallest and of the largest size: the latency is what a tiny
    transfer costs and the bandwidth what a large one adds per byte. A least-squares line
    over every size lets the largest transfers' noise decide the latency, and an emulated
    link's burst allowance (small transfers free) bend the slope."""
    by_size: dict[int, list[float]] = {}
    for size, seconds in samples:
        by_size.setdefault(int(size), []).append(float(seconds))
    small, large = min(by_size), max(by_size)
    t_small, t_large = statistics.median(by_size[small]), statistics.median(by_size[large])
    per_byte = (t_large - t_small) / (large - small) if large > small else 0.0
    return _link(per_byte, t_small - small * max(per_byte, 0.0))


def transfer_sizes(max_bytes: float, floor: int = 4 << 20, cap: int = 64 << 20) -> list[int]:
    """Probe sizes: 1 KiB, then x4 steps up to the largest tensor the job moves (at least
    `floor`, at most `cap`), so the fit covers the sizes that matter."""
    top = int(min(max(max_bytes, floor), cap))
    sizes, size = [], 1 << 10
    while size < top:
        sizes.append(size)
        size *= 4
    return sizes + [top]


def profile_transfers(store, run_prefix: str, max_bytes: float = 0, repeats: int = 3,
                      handoff_s: float | None = None) -> TransferProfile:
    """Time put (encode + upload) and get (download, delete, decode: what a pipeline stage's
    download thread does with each tensor) of float32 tensors of
    `transfer_sizes(max_bytes)` bytes through `store`, fit each to latency + bytes /
    bandwidth (`fit_endpoints`), and take the hand-off delay (`handoff_s`, measured by
    `measure_handoff` when None). Keys live under `run_prefix` and are deleted."""
    from training.tensor_codec import decode_tensors, encode_tensors

    puts, gets = [], []
    key_base = f"{run_prefix}/transfers-{uuid.uuid4().hex[:8]}"
    try:
        for size in transfer_sizes(max_bytes):
            tensor = torch.randn(max(1, size // 4), generator=torch.Generator().manual_seed(size))
            for i in range(repeats + 1):  # the first of each size is a warm-up
                key = f"{key_base}/{size}-{i}"
                t0 = time.perf_counter()
                store.put(key, encode_tensors({"t": tensor}), scratch=True)
                t1 = time.perf_counter()
                blob = store.get(key)
                store.delete(key)  # a stage's download thread deletes each key it read
                decode_tensors(blob)
                t2 = time.perf_counter()
                if i:
                    puts.append((size, t1 - t0))
                    gets.append((size, t2 - t1))
    finally:
        store.delete_prefix(key_base)
    put_bw, put_lat = fit_endpoints(puts)
    get_bw, get_lat = fit_endpoints(gets)
    if handoff_s is None:
        handoff_s = measure_handoff(store, run_prefix)
    return TransferProfile(put_latency_s=put_lat, put_bandwidth=put_bw, get_latency_s=get_lat,
                           get_bandwidth=get_bw, handoff_s=handoff_s)


def probe_store_side(store, run_prefix: str, model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor,
                     num_classes: int, *, max_bytes: float = 0, microbatch_size: int = 1,
                     activation_bytes: float = 0) -> dict:
    """The store side of a profile, as a worker would see it (one torch thread, the
    allocator pinned): the contract's bandwidth and latency (`profile_store`) and a
    worker's put and get costs up to `max_bytes` (`profile_transfers`), both with one
    hand-off measurement; a training step on (`x`, `y`) right after a sync checkpoint write
    and the write itself (`time_steps_between_checkpoints`); and, with `activation_bytes`
    (a pipeline may be planned), the contention factor at `microbatch_size` rows under
    transfers of that size. Keys live under `run_prefix` and are deleted."""
    from training.malloc import pin_malloc_thresholds

    torch.set_num_threads(1)
    pin_malloc_thresholds()
    handoff_s = measure_handoff(store, run_prefix)
    bandwidth, latency = profile_store(store, run_prefix, handoff_s=handoff_s)
    transfer = profile_transfers(store, run_prefix, max_bytes, handoff_s=handoff_s)
    synced_step_s, checkpoint_s = time_steps_between_checkpoints(store, run_prefix, model, optimizer, x, y)
    contention = 1.0
    if activation_bytes > 0:
        contention = measure_contention(model, tuple(x.shape[1:]), num_classes, microbatch_size, store,
                                        run_prefix, payload_bytes=int(activation_bytes)).factor
    return {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency, "transfer": transfer.to_dict(),
            "checkpoint_s": checkpoint_s, "synced_step_s": synced_step_s, "contention": contention}


def fit_scatter_reduce(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float]:
    """(bandwidth, latency) that make FuncPipe's scatter-reduce model (Eq. 1,
    `planners.sync_time.scatter_reduce`) fit timed collectives (bytes, workers, seconds),
    by least squares on the relative error: the effective link of the store collective as
    implemented (encoding, reduction and the peers' waits included)."""
    rows = [((3 - 2 / n) * s, 4.0) for s, n, _ in samples]
    t = np.array([sec for _, _, sec in samples], dtype=float)
    coef, *_ = np.linalg.lstsq(np.array(rows, dtype=float) / t[:, None], np.ones(len(rows)), rcond=None)
    return _link(float(coef[0]), float(coef[1]))


@dataclass(frozen=True)
class CollectiveTiming:
    """What `time_store_collective` measured among real worker processes."""

    samples: list[tuple[int, int, float]]
    """(bytes, workers, seconds) of each timed allreduce size and world."""
    handoff_s: float | None = None
    """Mean notice delay of a new key to a worker process waiting for it (None: no world
    of 2 or more): the put's end in one process to the waiting thread resuming with the
    decoded tensor in the other, less what fetching a key that is already there costs."""
    synced_step_s: float | None = None
    """A training step timed right after each full-size allreduce in every process of the
    first world of 2 or more, as a Local-SGD replica steps after its sync beside its peers
    (the slowest process's median; None: no `step` asked for)."""


def time_store_collective(store_url: str, run_prefix: str, nbytes: float = 0, *,
                          model: str | None = None, model_kwargs: dict | None = None,
                          optimizer: str = "sgd", worlds: Sequence[int] = (2,), repeats: int = 3,
                          timeout_s: float = 120.0, handoff_rounds: int = 24, min_seconds: float = 1.0,
                          opener: str = "training.store:open_store", step: dict | None = None) -> CollectiveTiming:
    """(bytes, workers, seconds) of the plain store allreduce (`training.collectives.
    allreduce_mean`, what Local-SGD averages with) among `workers` real processes, one torch
    thread each as workers run: on the tensors a Local-SGD replica of `model` averages
    (parameters, float buffers, the optimizer's moments; `model_kwargs` as the job builds it)
    when given, else on `nbytes` in 8 tensors, and on an eighth of those bytes, so the
    scatter-reduce model can be fitted through both sizes. Each call's seconds are its
    slowest rank's; the median of `repeats` calls after a warm-up is kept, and of more calls
    while they have taken under `min_seconds` per size (a vgg11-sized allreduce through the
    directory store, three calls each, gave 129 to 243 ms from one probe to the next; five
    calls still 160 to 253 ms: the machine's speed wanders on a scale of tens of seconds).
    Processes run in
    their own process group and are stopped by pid on failure. `opener` ("module:function")
    opens `store_url` in each rank (the coordinator passes its block-aware opener).

    Ranks 0 and 1 of the first world of 2 or more then pass a small tensor back and forth
    `handoff_rounds` times, as neighbouring pipeline stages do: the writer puts at a random
    phase of the reader's polls, the reader fetches through a download thread and its main
    thread waits for the result (`handoff_s`, see `CollectiveTiming`).

    With `step` ({"input_shape", "classes", "batch_size"}) and a `model`, every rank of that
    world also times one training step of its replica right after each full-size call
    (`synced_step_s`)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from training.subprocess_env import one_thread_env

    if model is None and not nbytes > 0:
        raise ValueError("nbytes: give a model or a positive byte count to time the collective on")
    samples, handoff_s, synced_step_s = [], None, None
    for world in worlds:
        group = f"{run_prefix}/collective-{uuid.uuid4().hex[:8]}"
        config = {"store_url": store_url, "group": group, "world": world, "nbytes": nbytes,
                  "model": model, "model_kwargs": model_kwargs or {}, "optimizer": optimizer,
                  "repeats": repeats, "timeout_s": timeout_s, "opener": opener, "min_s": min_seconds,
                  "handoff_rounds": handoff_rounds if world >= 2 and handoff_s is None else 0,
                  "step": step if model and world >= 2 and synced_step_s is None else None,
                  "parent_pid": os.getpid()}
        procs = [subprocess.Popen([sys.executable, "-m", "training.links", json.dumps(config), str(rank)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=one_thread_env(),
                                  start_new_session=True, text=True) for rank in range(world)]
        try:
            outs = [p.communicate(timeout=timeout_s * (repeats + 1) * 2 + 60) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            store = _opener(opener)(store_url)
            try:
                store.delete_prefix(group)  # the barrier calls leave their results behind
            finally:
                store.close()
        bad = [(p.returncode, err) for p, (_, err) in zip(procs, outs) if p.returncode]
        if bad:
            raise RuntimeError(f"timed collective among {world} processes failed: "
                               f"{bad[0][1].strip().splitlines()[-1:] or bad[0][0]}")
        per_rank = [json.loads(out) for out, _ in outs]
        if config["handoff_rounds"]:
            handoff_s = _handoff_from_ping_pong([r.pop("handoff") for r in per_rank[:2]])
        if config["step"]:
            synced_step_s = max(statistics.median(r.pop("synced_step")) for r in per_rank)
        for size in per_rank[0]:
            calls = zip(*(r[size] for r in per_rank))
            samples.append((int(size), world, statistics.median(max(c) for c in calls)))
    return CollectiveTiming(sorted(samples), handoff_s, synced_step_s)


def _handoff_from_ping_pong(ranks: list[dict]) -> float:
    """Mean (seen - put end) over both directions, less the median fetch of a present key.
    Both ranks ran on this host: their `perf_counter` stamps share CLOCK_MONOTONIC."""
    delays = [reader["seen"][i] - writer["put_end"][i]
              for reader, writer in ((ranks[0], ranks[1]), (ranks[1], ranks[0]))
              for i in reader["seen"]]
    present = statistics.median(ranks[0]["present"] + ranks[1]["present"])
    return max(0.0, statistics.fmean(delays) - present)


def _ping_pong(store, prefix: str, rank: int, rounds: int, timeout_s: float) -> dict:
    """Rank 0 or 1 of the hand-off probe: round i is written by rank i % 2 and read by the
    other, which has been waiting since its own put. Returns this rank's stamps."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from training.tensor_codec import decode_tensors, encode_tensors

    rng, spread = random.Random(rank), _poll_interval(store)
    blob = encode_tensors({"t": torch.randn(256, generator=torch.Generator().manual_seed(rank))})

    def fetch(key):
        data = store.get(key, timeout=timeout_s)
        store.delete(key)
        return decode_tensors(data)

    put_end, seen, present = {}, {}, []
    with ThreadPoolExecutor(1, thread_name_prefix="download") as download:
        for i in range(rounds):
            key = f"{prefix}/{i}"
            if i % 2 == rank:
                time.sleep(0.0005 + rng.uniform(0, spread))
                store.put(key, blob, scratch=True)
                put_end[str(i)] = time.perf_counter()
            else:
                download.submit(fetch, key).result()
                seen[str(i)] = time.perf_counter()
        for i in range(5):  # the part of a waiting fetch that is not the notice delay
            key = f"{prefix}/present-{rank}-{i}"
            store.put(key, blob, scratch=True)
            t0 = time.perf_counter()
            download.submit(fetch, key).result()
            present.append(time.perf_counter() - t0)
    return {"put_end": put_end, "seen": seen, "present": present}


def _opener(path: str) -> Callable[[str], object]:
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def replica_tensors(model: str, model_kwargs: dict, optimizer: str) -> dict[str, torch.Tensor]:
    """What a Local-SGD replica of `model` averages at each sync: parameters, floating
    buffers and the optimizer's moments (created by one step on zero gradients)."""
    return _replica(model, model_kwargs, optimizer)[2]


def _replica(model: str, model_kwargs: dict, optimizer: str):
    """(module, optimizer, the tensors it averages: sharing the module's memory)."""
    from training.models import build_model
    from training.optimizers import build_optimizer, optimizer_state_tensors

    net = build_model(model, 0, **model_kwargs)
    opt = build_optimizer(optimizer, net, 1e-3)  # zero gradients: the weights do not move
    for param in net.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    out = {f"param/{n}": p.data for n, p in net.named_parameters()}
    out.update({f"buffer/{n}": b for n, b in net.named_buffers() if b.is_floating_point()})
    out.update({f"optim/{n}": t for n, t in optimizer_state_tensors(net, opt).items()
                if t.is_floating_point() and t.dim() > 0})
    return net, opt, out


def _total_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def step_timer(net: nn.Module, opt, shape: dict, seed: int = 0) -> Callable[[], float]:
    """A training step of `net` with `opt` on a fixed random batch of `shape`
    ({"input_shape", "classes", "batch_size"}) drawn from `seed`; each call returns its
    seconds."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape["batch_size"], *shape["input_shape"], generator=gen)
    y = torch.randint(0, shape["classes"], (shape["batch_size"],), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    return step


def _collective_rank(config: dict, rank: int) -> dict:
    """One rank of `time_store_collective`: seconds of each timed call, by bytes, and ranks
    0 and 1's hand-off stamps under "handoff" when asked (`_ping_pong`). Calls start
    together (a barrier through the store) so a call's time is the collective's, not a
    late start's; each call cleans up the previous one's keys as Local-SGD does."""
    from training.collectives import allreduce_mean, release_group
    from training.malloc import pin_malloc_thresholds
    from training.subprocess_env import exit_when_orphaned

    if config.get("parent_pid"):
        exit_when_orphaned(config["parent_pid"])  # its own session: a dead parent cannot stop it
    torch.set_num_threads(1)
    pin_malloc_thresholds()
    step = None
    if config["model"]:
        net, opt, full = _replica(config["model"], config["model_kwargs"], config["optimizer"])
        if config.get("step"):
            step = step_timer(net, opt, config["step"])
    else:
        full = {f"p{i}": c.clone() for i, c in
                enumerate(torch.randn(max(8, int(config["nbytes"]) // 4)).tensor_split(8))}
    nbytes = _total_bytes(full)
    # an eighth of the bytes in as many tensors: the second point of the fit
    small = {f"p{i}": c.clone() for i, c in enumerate(torch.randn(max(len(full), nbytes // 32)).tensor_split(len(full)))}
    world, group, timeout_s = config["world"], config["group"], config["timeout_s"]
    store = _opener(config["opener"])(config["store_url"])
    out = {}
    repeats = config["repeats"]
    try:
        call = barrier = 0
        for tensors in (small, full):
            times, spent, warm = [], 0.0, False
            while True:
                # the barrier also agrees on when to stop: `repeats` calls after a warm-up,
                # more while the ranks' mean time spent is under min_s
                agreed = allreduce_mean(store, f"{group}/barrier{barrier}", rank, world,
                                        {"b": torch.tensor([spent], dtype=torch.float64)}, timeout_s)
                barrier += 1
                if len(times) >= repeats and (float(agreed["b"]) >= config["min_s"] or len(times) >= 50 * repeats):
                    break
                t0 = time.perf_counter()
                allreduce_mean(store, f"{group}/r{call}", rank, world, tensors, timeout_s,
                               previous_prefix=f"{group}/r{call - 1}" if call else None)
                if warm:  # each size's first call is a warm-up
                    times.append(time.perf_counter() - t0)
                    spent += times[-1]
                    if step and tensors is full:
                        out.setdefault("synced_step", []).append(step())
                warm, call = True, call + 1
            out[str(_total_bytes(tensors))] = times
        if config["handoff_rounds"] and rank < 2:
            out["handoff"] = _ping_pong(store, f"{group}/handoff", rank, config["handoff_rounds"], timeout_s)
        release_group(store, group, rank, world, timeout_s)
    finally:
        store.close()
    return out


def time_steps_between_checkpoints(store, run_prefix: str, model: nn.Module, optimizer, x: torch.Tensor,
                                   y: torch.Tensor, repeats: int = 5) -> tuple[float, float]:
    """(step seconds, checkpoint seconds), medians over `repeats` rounds (more while the rounds
    have taken under 2 x `ANCHOR_MIN_S`) of one training step
    on (`x`, `y`) followed by a checkpoint write (`training.checkpoint.save_checkpoint`), as
    a Local-SGD replica syncing every step runs them: a step right after a write is slower
    than one in a tight loop (the encoding evicts the caches, the kernel writes back the
    fsynced pages), by 0-60 % measured here. After a warm-up round; the keys are deleted,
    and the model's weights and optimizer state are restored."""
    from training.checkpoint import save_checkpoint

    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    loss_fn = nn.CrossEntropyLoss()
    key_base = f"{run_prefix}/checkpoint-{uuid.uuid4().hex[:8]}"
    steps, writes = [], []
    began = time.perf_counter()
    try:
        i = 0
        while i <= repeats or (time.perf_counter() - began < 2 * ANCHOR_MIN_S and i <= 100 * repeats):
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
            t1 = time.perf_counter()
            save_checkpoint(store, f"{key_base}/{i % 2}", model, optimizer, {"step": i})
            if i:
                steps.append(t1 - t0)
                writes.append(time.perf_counter() - t1)
            i += 1
    finally:
        store.delete_prefix(key_base)
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        model.zero_grad(set_to_none=True)
    return statistics.median(steps), statistics.median(writes)


if __name__ == "__main__":  # a rank of `time_store_collective`: argv = config JSON, rank
    import json
    import sys

    print(json.dumps(_collective_rank(json.loads(sys.argv[1]), int(sys.argv[2]))))

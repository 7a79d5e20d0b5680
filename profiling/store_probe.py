"""The link side of a profile: the store and the collectives the workers will sync through.

Not cached (a store's speed depends on where it runs):

- `profile_store`: the store's bandwidth and latency in the planners' contract form (one
  bandwidth, one latency per transfer), with the hand-off delay of a polling store
  (`measure_handoff`);
- `profile_transfers`: what a worker's transfer really costs, put (encode + upload) and get
  (download + decode) fitted apart, at sizes up to the tensors the job will move;
- `measure_contention`: FuncPipe's beta, compute slowdown while transfers run (Sec. 3.4.2);
- `time_steps_between_checkpoints`: the sync checkpoint write and the step right after it.

`probe_store_side` runs them all, in the worker that profiles (`profiling.profile_job`).
The store collectives are not timed here: the first epoch's measured sync calibrates them
(`planners.calibration`).
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from comm.tensor_codec import decode_tensors, encode_tensors
from engine.checkpoint import save_checkpoint
from engine.malloc import pin_malloc_thresholds
from core.stage_memory import optimizer_copies
from profiling.memory import _param_bytes
from profiling.sample import input_dtype_of, profile_loss, sample_batch, target_dtype_of
from profiling.timing import ANCHOR_MIN_S, _median_time, layer_output_bytes


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
                       payload_bytes: int = 4 << 20, repeats: int = 5, input_dtype: str = "float32",
                       target_shape: Sequence[int] = (), target_dtype: str = "int64",
                       loss: str | None = None) -> ContentionResult:
    """Forward + backward of `model` on one micro-batch, timed alone and while a background
    thread uploads and downloads `payload_bytes` to `store` without pause (FuncPipe's
    beta: compute slows while a worker's transfers run). Each phase is a median over at
    least `ANCHOR_MIN_S` (five single calls varied the factor from 1.0 to 1.46 for one
    model); alone is timed before and after the loaded phase and averaged, so a drift in
    machine load does not pass for contention. The micro-batch is shaped as the job's data
    (`profiling.sample.sample_batch`: `input_dtype`, `target_shape`, `target_dtype`) and scored by
    the job's `loss`."""
    device = next(model.parameters(), torch.empty(0)).device
    x, y = sample_batch(input_shape, num_classes, microbatch_size, generator=torch.Generator().manual_seed(1),
                        input_dtype=input_dtype, target_shape=tuple(target_shape), target_dtype=target_dtype,
                        device=device)

    def compute() -> None:
        model.zero_grad(set_to_none=True)
        profile_loss(model(x), y, loss).backward()

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


# --- what a worker's transfers really cost ------------------------------


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


def probe_sizes(model: nn.Module, x_micro: torch.Tensor, optimizer: str, pipeline: bool) -> tuple[float, float]:
    """(largest, activation) bytes a store probe of this job is sized by, from its model: the
    largest tensor the job moves (one sync's parameters and optimizer moments, or a layer's
    output on the micro-batch `x_micro`) and, where a pipeline may be planned, the median
    layer output (the contention probe's transfer size; 0 otherwise)."""
    outputs = sorted(layer_output_bytes(model, x_micro))
    sync = _param_bytes(model) * (1 + optimizer_copies(optimizer))
    activation = outputs[len(outputs) // 2] if pipeline and outputs else 0
    return float(max([sync] + outputs)), float(activation)


def probe_store_side(store, run_prefix: str, model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor,
                     num_classes: int, *, max_bytes: float = 0, microbatch_size: int = 1,
                     activation_bytes: float = 0, loss: str | None = None) -> dict:
    """The store side of a profile, as the worker running it sees it (its own threads, the
    allocator pinned): the contract's bandwidth and latency (`profile_store`) and a
    worker's put and get costs up to `max_bytes` (`profile_transfers`), both with one
    hand-off measurement; a training step on (`x`, `y`) right after a sync checkpoint write
    and the write itself (`time_steps_between_checkpoints`); and, with `activation_bytes`
    (a pipeline may be planned), the contention factor at `microbatch_size` rows under
    transfers of that size. Keys live under `run_prefix` and are deleted."""
    pin_malloc_thresholds()
    handoff_s = measure_handoff(store, run_prefix)
    bandwidth, latency = profile_store(store, run_prefix, handoff_s=handoff_s)
    transfer = profile_transfers(store, run_prefix, max_bytes, handoff_s=handoff_s)
    synced_step_s, checkpoint_s = time_steps_between_checkpoints(store, run_prefix, model, optimizer, x, y,
                                                                 loss=loss)
    contention = 1.0
    if activation_bytes > 0:
        contention = measure_contention(model, tuple(x.shape[1:]), num_classes, microbatch_size, store,
                                        run_prefix, payload_bytes=int(activation_bytes),
                                        input_dtype=input_dtype_of(x), target_shape=tuple(y.shape[1:]),
                                        target_dtype=target_dtype_of(y), loss=loss).factor
    return {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency, "transfer": transfer.to_dict(),
            "checkpoint_s": checkpoint_s, "synced_step_s": synced_step_s, "contention": contention}


def time_steps_between_checkpoints(store, run_prefix: str, model: nn.Module, optimizer, x: torch.Tensor,
                                   y: torch.Tensor, repeats: int = 5, loss: str | None = None) -> tuple[float, float]:
    """(step seconds, checkpoint seconds), medians over `repeats` rounds (more while the rounds
    have taken under 2 x `ANCHOR_MIN_S`) of one training step
    on (`x`, `y`) followed by a checkpoint write (`engine.checkpoint.save_checkpoint`), as
    a Local-SGD replica syncing every step runs them: a step right after a write is slower
    than one in a tight loop (the encoding evicts the caches, the kernel writes back the
    fsynced pages), by 0-60 % measured here. After a warm-up round; the keys are deleted,
    and the model's weights and optimizer state are restored."""
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    key_base = f"{run_prefix}/checkpoint-{uuid.uuid4().hex[:8]}"
    steps, writes = [], []
    began = time.perf_counter()
    try:
        i = 0
        while i <= repeats or (time.perf_counter() - began < 2 * ANCHOR_MIN_S and i <= 100 * repeats):
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            profile_loss(model(x), y, loss).backward()
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

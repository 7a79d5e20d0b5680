"""Sync time of the pipelined scatter-reduce next to the plain three-phase one, in one run.

For Redis and S3 (moto), with and without emulated per-worker links, and for n ranks and
model sizes s, each rank (its own process and store client, as a worker would be) reduces
an s-byte float32 tensor with both algorithms, interleaved, several times; the sync time of
a round is the slowest rank's time from a common barrier. Beside it stands FuncPipe's
model, Eq. 1 (plain: 3 s/w - 2 s/(n w) + 4 t_lat) and Eq. 2 (pipelined: 2 s/w + (n + 2)
t_lat), with w the emulated per-direction bandwidth and t_lat a measured small put/get.

Emulated links: each rank's client paces uploads and downloads with independent token
buckets (`comm.bandwidth`), but with `causal_link`, so that a key is visible only once
its emulated upload has ended (see there why the store's own pacing is not used as is).

Why emulated sizes are scaled: the model holds while each worker's link, not the store,
is the bottleneck. n = 8 workers at 70 MB/s move about 1.5 n w = 840 MB/s through the
store, which one redis-server or moto on a shared 2-core machine cannot serve (measured:
100-230 MB/s for Redis, 40-180 MB/s for moto, see results/stores.md). So the emulated runs
divide both the sizes and the bandwidth by 70: every transfer then takes as long as the
paper's unscaled one (280 MB at 70 MB/s becomes 4 MB at 1 MB/s: 11 s plain, 8 s pipelined
at n = 8) and the ratios the model predicts are unchanged, while the store stays far below
saturation. Unemulated runs use real sizes (10-70 MB; 280 MB x 8 ranks would need about
10 GB of memory on a machine shared with others).

    .venv/bin/python -m benchmarks.bench_scatter_reduce [--quick] [--repeats 2]

Starts its own redis-server and moto server on free 127.0.0.1 ports and stops them.
Writes markdown with the command to `benchmarks/results/scatter_reduce.md`.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.home import scratch
from benchmarks.harness.servers import moto_server, redis_server, stop_server
from benchmarks.harness.tables import median, table
from benchmarks.output import command_for, provenance, write_result
from core.keys import run_key

MB = 1_000_000
RESULTS = Path(__file__).resolve().parent / "results" / "scatter_reduce.md"
SOURCES = ("comm", "core/errors.py", "core/keys.py", "core/outer_sync.py", "core/object_requests.py", "core/polling.py", "core/process_start.py",
           "core/store_ops.py", "planners/checks.py", "planners/sync_time.py", "deployments/server.py",
           "deployments/prefect_db.py", "requirements.lock", "benchmarks/harness/servers.py",
           "benchmarks/harness/tables.py")
"""The code it measures (the collectives over the stores, and the planner's prediction of them): its
results file is stale once one of these changed since the commit the file names
(`benchmarks.staleness`)."""


@dataclass(frozen=True)
class Sweep:
    """One table: a store, a link setting, rank counts and sizes."""

    store: str
    """`redis` or `s3`."""
    bandwidth: float | None
    """Emulated bytes/s per direction per worker; None = loopback as is."""
    scale: int
    """Paper-equivalent size = measured size x scale (1 when unscaled)."""
    ranks: tuple[int, ...]
    sizes_mb: tuple[float, ...]


def sweeps(quick: bool) -> list[Sweep]:
    """The default sweep, or a small one for a smoke run."""
    if quick:
        return [Sweep("redis", 1 * MB, 70, (2, 8), (1,)),
                Sweep("s3", 1 * MB, 70, (4,), (1,)),
                Sweep("redis", None, 1, (4,), (10,))]
    return [
        Sweep("redis", 1 * MB, 70, (2, 4, 6, 8), (10 / 70, 1, 4)),
        Sweep("s3", 1 * MB, 70, (2, 4, 8), (10 / 70, 1, 4)),
        Sweep("redis", None, 1, (2, 4, 8), (10, 70)),
        Sweep("s3", None, 1, (2, 4, 8), (10, 40)),
    ]


# --- the model ---------------------------------------------------------------------------

def model_times(size: float, bandwidth: float, ranks: int, latency: float) -> tuple[float, float, str]:
    """(plain, pipelined) sync seconds by FuncPipe Eq. 1 and 2, and where they came from."""
    try:
        from planners import sync_time  # the planners' version, once it exists

        return (sync_time.scatter_reduce(size, ranks, bandwidth, latency),
                sync_time.pipelined_scatter_reduce(size, ranks, bandwidth, latency),
                "planners.sync_time")
    except (ImportError, AttributeError, TypeError):
        plain = 3 * size / bandwidth - 2 * size / (ranks * bandwidth) + 4 * latency
        piped = 2 * size / bandwidth + (ranks + 2) * latency
        return plain, piped, "local Eq. 1/2 (planners.sync_time not available)"


# --- one rank ----------------------------------------------------------------------------

def causal_link(bandwidth: float | None):
    """A `comm.bandwidth.Link` whose uploads become visible only when the emulated
    transfer ends.

    The store's own `Link.upload` writes the bytes first and then sleeps out the emulated
    time, so a reader can fetch a key while its writer's upload is still "on the wire"; a
    pipelined algorithm, whose downloads chase its peers' uploads, would then overlap two
    transfers that cannot overlap on real links, and look up to s/(n w) per step faster.
    Here the write happens at the deadline instead (its real loopback time, milliseconds,
    comes on top).
    """
    from comm.bandwidth import Link, sleep_until

    class CausalLink(Link):
        def upload(self, nbytes, transfer) -> None:
            start = time.monotonic()
            sleep_until(self.up.reserve(nbytes) if self.up else start)
            transfer()
            with self._lock:
                self.stats.bytes_up += nbytes
                self.stats.upload_s += time.monotonic() - start

    return CausalLink(bandwidth, bandwidth)


def rank_main(rank: int, ranks: int, url: str, bandwidth, plan, barrier, results) -> None:
    """A worker process: for each (size, algorithm, repeat), wait at the barrier, reduce,
    report the seconds; check the result once per call."""
    import torch

    from comm.collectives import release_group
    from comm.scatter_reduce import allreduce_for
    from comm.store import open_store

    store = open_store(url)
    store.link = causal_link(bandwidth)
    group = run_key("bench", "sync", f"n{ranks}")
    previous = None
    try:
        for i, (size, algorithm, repeat) in enumerate(plan):
            tensors = {"g": torch.full((int(size) // 4,), float(rank + 1))}
            prefix = f"{group}/c{i}"
            barrier.wait()
            began, cpu = time.perf_counter(), time.process_time()
            out = allreduce_for(algorithm)(store, prefix, rank, ranks, tensors, 600.0,
                                           previous_prefix=previous)
            seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
            previous = prefix
            ok = bool(out["g"][0] == (ranks + 1) / 2 and out["g"][-1] == (ranks + 1) / 2)
            results.put((size, algorithm, repeat, rank, seconds, ok, cpu))
        release_group(store, group, rank, ranks, 600.0)
    except BaseException as exc:  # reported, so the parent stops waiting
        results.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        store.close()


def run_sweep_point(url: str, ranks: int, sizes: list[int], bandwidth, repeats: int) -> dict:
    """Median slowest-rank seconds per (size, algorithm) for `ranks` processes."""
    plan = [(size, algorithm, r) for size in sizes for r in range(repeats)
            for algorithm in (("plain", "pipelined") if r % 2 == 0 else ("pipelined", "plain"))]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, ranks, url, bandwidth, plan, barrier, results))
             for r in range(ranks)]
    for p in procs:
        p.start()
    rows = []
    try:
        for _ in range(len(plan) * ranks):
            row = results.get(timeout=1800)
            if row[0] == "error":
                raise RuntimeError(f"rank {row[1]} failed: {row[2]}")
            rows.append(row)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
    if not all(row[5] for row in rows):
        raise RuntimeError("a reduction returned a wrong mean")
    slowest: dict[tuple, float] = {}
    cpu: dict[tuple, float] = {}
    for size, algorithm, repeat, _, seconds, _, cpu_s in rows:
        key = (size, algorithm, repeat)
        slowest[key] = max(slowest.get(key, 0.0), seconds)
        cpu[key] = max(cpu.get(key, 0.0), cpu_s)
    return {(size, algorithm): (median(slowest[(size, algorithm, r)] for r in range(repeats)),
                                median(cpu[(size, algorithm, r)] for r in range(repeats)))
            for size in sizes for algorithm in ("plain", "pipelined")}


def measure_latency(url: str) -> float:
    """Median of (put + get of 1 kB) / 2 on an unpaced client: the per-request t_lat."""
    from comm.store import open_store

    store = open_store(url)
    samples = []
    for i in range(30):
        t0 = time.perf_counter()
        store.put(run_key("bench", "lat", str(i)), b"x" * 1000)
        store.get(run_key("bench", "lat", str(i)))
        samples.append((time.perf_counter() - t0) / 2)
    store.delete_prefix(run_key("bench", "lat") + "/")
    store.close()
    return median(samples)


def measure_bandwidth(url: str, size: int) -> float:
    """One unpaced client's put+get bandwidth (bytes/s) for `size` bytes: the w the model
    gets for the unemulated rows (it ignores that n clients share one store)."""
    from comm.store import open_store

    store = open_store(url)
    blob = os.urandom(size)
    times = []
    for i in range(2):
        t0 = time.perf_counter()
        store.put(run_key("bench", "bw", str(i)), blob)
        store.get(run_key("bench", "bw", str(i)))
        times.append((time.perf_counter() - t0) / 2)
    store.delete_prefix(run_key("bench", "bw") + "/")
    store.close()
    return size / min(times)


# --- report ------------------------------------------------------------------------------

def sweep_table(sweep: Sweep, measured: dict, latency: float, bandwidth: float) -> tuple[str, str]:
    """Markdown rows for one sweep, and where the model came from."""
    link = (f"emulated {sweep.bandwidth / MB:g} MB/s per direction per worker"
            if sweep.bandwidth else f"loopback, no emulation (model w = one client's {bandwidth / MB:.0f} MB/s)")
    scaled = f", sizes x{sweep.scale} = paper-equivalent at {sweep.bandwidth * sweep.scale / MB:g} MB/s" \
        if sweep.scale > 1 else ""
    head = [f"### {sweep.store}, {link}{scaled}", "",
            f"t_lat = {latency * 1000:.1f} ms (measured).", "",
            *table(["n", "size MB", "(paper-equiv. MB)", "plain s", "pipelined s", "lower by", "model plain s",
                    "model pipelined s", "model lower by", "plain vs model", "pipelined vs model",
                    "CPU s/rank plain, pipelined"])]
    source = ""
    for (ranks, size), ((plain, cpu_plain), (piped, cpu_piped)) in sorted(measured.items()):
        m_plain, m_piped, source = model_times(size, bandwidth, ranks, latency)
        head.append(
            f"| {ranks} | {size / MB:.2f} | {size * sweep.scale / MB:.0f} | {plain:.2f} | {piped:.2f} | "
            f"{100 * (1 - piped / plain):.0f} % | {m_plain:.2f} | {m_piped:.2f} | "
            f"{100 * (1 - m_piped / m_plain):.0f} % | {100 * (plain / m_plain - 1):+.0f} % | "
            f"{100 * (piped / m_piped - 1):+.0f} % | {cpu_plain:.2f}, {cpu_piped:.2f} |")
    return "\n".join(head), source


def main(argv: list[str] | None = None) -> None:
    """Run the sweeps and write the markdown report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke sweep")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per algorithm and point")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    prov = provenance()

    servers = []
    sections, sources = [], set()
    with scratch("sr") as work:
        try:
            redis, redis_url = redis_server(work)
            servers.append(redis)
            moto, endpoint = moto_server(work)
            servers.append(moto)
            urls = {"redis": redis_url, "s3": f"s3://bench/zooid?endpoint={endpoint}"}
            for sweep in sweeps(args.quick):
                url = urls[sweep.store]
                latency = measure_latency(url)
                sizes = [int(s * MB) for s in sweep.sizes_mb]
                bandwidth = sweep.bandwidth or measure_bandwidth(url, max(sizes))
                measured = {}
                for ranks in sweep.ranks:
                    print(f"{sweep.store} w={sweep.bandwidth} n={ranks} ...", file=sys.stderr, flush=True)
                    point = run_sweep_point(url, ranks, sizes, sweep.bandwidth, args.repeats)
                    for size in sizes:
                        measured[(ranks, size)] = (point[(size, "plain")], point[(size, "pipelined")])
                text, source = sweep_table(sweep, measured, latency, bandwidth)
                sections.append(text)
                sources.add(source)
        finally:
            for proc in servers:
                stop_server(proc)

    command = command_for("benchmarks.bench_scatter_reduce", argv)
    text = "\n".join([
        f"Each rank is a process with its own store client; a round's time is the slowest "
        f"rank's, from a common barrier; median of {args.repeats} interleaved rounds. "
        f"'lower by' = 1 - pipelined / plain. Model: FuncPipe Eq. 1 and 2 ({'; '.join(sorted(sources))}). "
        "Emulated sizes and bandwidths are both scaled down (see the module docstring): a "
        "scaled run takes as long as the paper-equivalent one and keeps the model's ratios, "
        "while the store is not the bottleneck. Unemulated rows share one store and two cores, "
        "which the model (independent per-worker links) does not describe.",
        "",
        *[s + "\n" for s in sections],
    ])
    write_result(args.out, "Pipelined vs plain scatter-reduce through the store (FuncPipe Sec. 3.3)", command, prov,
                 text, detail="every rank is a process; the stores' servers run on the same cores", echo=True)


if __name__ == "__main__":
    main()

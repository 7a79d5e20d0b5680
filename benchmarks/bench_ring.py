"""The CPU ring's transport (`comm.socket_ring`, behind `comm.ring_allreduce.open_ring`) beside
gloo, the backend torch.distributed and DDP use on CPU, side by side in one run.

Two worker processes (one torch thread each, as Zooid's workers on this machine) open both
rings at once: Zooid's (`open_ring` on a directory store) and a gloo process group built the
way `init_process_group` builds it (a TCPStore, `ProcessGroupGloo` with its defaults). Per
buffer size, `--rounds` rounds interleave the two: `--calls` allreduce-means of one flat
float32 buffer in place on each (the transport's sum, then a division: `RingGroup.sum_in_place`
against gloo's `allreduce`; the copies a dict of tensors costs in and out are left out of both), timed on rank 0 from the first call's start to the last call's end. The table
gives the median seconds per call over the rounds and the ratio. The sizes: 4 KB (latency),
153 KB (digits_cnn's gradients, the every-step job of `bench_peers`), 4 MB and 40 MB
(bandwidth).

    .venv/bin/python -m benchmarks.bench_ring [--rounds 5] [--calls 200] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness.home import scratch
from benchmarks.harness.tables import median, table
from benchmarks.output import command_for, provenance, write_result
from comm.ring_allreduce import open_ring
from comm.store_dir import DirectoryStore
from deployments.server import free_port

RESULTS = Path(__file__).resolve().parent / "results" / "ring.md"
SOURCES = ("comm", "core/errors.py", "core/outer_sync.py", "core/object_requests.py", "core/polling.py", "core/process_start.py", "core/store_ops.py",
           "deployments/server.py", "deployments/prefect_db.py", "requirements.lock",
           "benchmarks/harness/tables.py")
"""The code it measures (the ring's transport beside gloo): its results file is stale once one of these
changed since the commit the file names (`benchmarks.staleness`)."""
TITLE = "The CPU ring's transport: TCP connections beside gloo"
SIZES = {"4 KB": 1_000, "153 KB": 38_282, "4 MB": 1_000_000, "40 MB": 10_000_000}


def _gloo(port: int, rank: int):
    tcp = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=60)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return tcp, dist.ProcessGroupGloo(tcp, rank, 2, options)


def _rank(rank: int, store_dir: str, port: int, rounds: int, calls: int, out: str) -> None:
    torch.set_num_threads(1)
    ring = open_ring(DirectoryStore(store_dir), "bench/ring", rank, 2, timeout=60)
    tcp, gloo = _gloo(port, rank)
    calls_of = {"zooid": lambda buf: (ring.sum_in_place(buf), buf.div_(2)),
                "gloo": lambda buf: (gloo.allreduce([buf]).wait(), buf.div_(2))}
    timings: dict[str, dict[str, list[float]]] = {size: {"zooid": [], "gloo": []} for size in SIZES}
    for size, n in SIZES.items():
        buf = torch.randn(n)
        for name, call in calls_of.items():  # warm-up: connections, allocations
            for _ in range(5):
                call(buf)
        for _ in range(rounds):
            for name, call in calls_of.items():
                count = calls if n < 1_000_000 else max(5, calls // 20)
                gloo.barrier().wait()
                began = time.perf_counter()
                for _ in range(count):
                    call(buf)
                timings[size][name].append((time.perf_counter() - began) / count)
    ring.close()
    gloo.shutdown()
    del tcp
    if rank == 0:
        Path(out).write_text(json.dumps(timings))


def run(rounds: int, calls: int) -> dict:
    """Spawn the two ranks and return rank 0's timings: {size: {"zooid"|"gloo": [s per call]}}."""
    with scratch("ring") as folder:
        out = os.path.join(folder, "timings.json")
        mp.spawn(_rank, args=(os.path.join(folder, "store"), free_port(0), rounds, calls, out), nprocs=2)
        return json.loads(Path(out).read_text())


def render(timings: dict) -> str:
    lines = table(["buffer", "Zooid's ring (TCP), per call", "gloo, per call", "Zooid / gloo"])
    for size, by in timings.items():
        z, g = median(by["zooid"]), median(by["gloo"])
        lines.append(f"| {size} | {z * 1e3:.3f} ms | {g * 1e3:.3f} ms | {z / g:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_ring", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    prov = provenance()
    timings = run(args.rounds, args.calls)
    body = (f"2 processes, one torch thread each, float32 allreduce-means; {args.rounds} rounds, the two "
            f"interleaved; {args.calls} calls a round (a twentieth of that for 4 MB and more); medians over "
            "the rounds of seconds per call on rank 0. Method: the module docstring of "
            "`benchmarks/bench_ring.py`.\n\n" + render(timings))
    write_result(args.out, TITLE, command_for("benchmarks.bench_ring", argv), prov, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

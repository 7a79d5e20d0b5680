"""Time models of one gradient synchronisation among data-parallel replicas.

- `scatter_reduce`: LambdaML's storage-based scatter-reduce as FuncPipe models it (Eq. 1):
  each of n workers uploads n - 1 chunks of s / n, downloads and reduces the n - 1 chunks
  of its own share, uploads the reduced share and downloads the n - 1 other shares, one
  phase after another: 3 s / w - 2 s / (n w) + 4 t_lat.
- `pipelined_scatter_reduce`: FuncPipe's variant (Eq. 2), which overlaps uploads and
  downloads of the first two phases: 2 s / w + (2 + n) t_lat.
- `ring_allreduce`: Hydrozoa's ring among A replicas, 2 (A - 1) rounds each moving P / A
  bytes plus a per-round overhead alpha P / A + beta (alpha, beta fitted by
  `planners.hybrid.fit_allreduce`).
- `parameter_server`: Cynthia Eq. 5, gradients pushed and parameters pulled through
  n_ps servers: BSP moves 2 g n_wk through their summed bandwidth, ASP 2 g per iteration.

All are 0 for a single worker (nothing to synchronise). `sync_time(doc)` is the
`sync-time` command of PLANNER_SPEC.md.
"""
from __future__ import annotations

from planners import checks as v

STORE_ALGORITHMS = ("scatter_reduce", "pipelined_scatter_reduce")


def scatter_reduce(nbytes: float, workers: int, bandwidth: float, latency: float) -> float:
    """Seconds for the three-phase storage scatter-reduce (FuncPipe Eq. 1)."""
    if workers <= 1:
        return 0.0
    return 3 * nbytes / bandwidth - 2 * nbytes / (workers * bandwidth) + 4 * latency


def pipelined_scatter_reduce(nbytes: float, workers: int, bandwidth: float,
                             latency: float) -> float:
    """Seconds for FuncPipe's pipelined scatter-reduce (Eq. 2)."""
    if workers <= 1:
        return 0.0
    return 2 * nbytes / bandwidth + (2 + workers) * latency


def ring_allreduce(nbytes: float, workers: int, bandwidth: float, alpha_s_per_byte: float,
                   beta_s: float) -> float:
    """Seconds for a ring allreduce of `nbytes` among `workers` replicas (Hydrozoa Sec. 3.4,
    with the ring among the A replicas of a stage as the contract states it)."""
    if workers <= 1:
        return 0.0
    chunk = nbytes / workers
    return 2 * (workers - 1) * (chunk / bandwidth + alpha_s_per_byte * chunk + beta_s)


def parameter_server(nbytes: float, workers: int, servers: int, bandwidth: float,
                     mode: str = "BSP") -> float:
    """Communication seconds per iteration through `servers` parameter servers of
    `bandwidth` each (Cynthia Eq. 5); `mode` is `BSP` or `ASP`."""
    if servers < 1:
        raise ValueError(f"servers: must be >= 1, got {servers}")
    if mode == "BSP":
        return 2 * nbytes * workers / (servers * bandwidth)
    if mode == "ASP":
        return 2 * nbytes / (servers * bandwidth)
    raise ValueError(f"mode: must be one of BSP, ASP, got {mode!r}")


def store_sync(algorithm: str, nbytes: float, workers: int, bandwidth: float,
               latency: float) -> float:
    """One of the storage collectives by name (`scatter_reduce` or
    `pipelined_scatter_reduce`)."""
    if algorithm == "scatter_reduce":
        return scatter_reduce(nbytes, workers, bandwidth, latency)
    if algorithm == "pipelined_scatter_reduce":
        return pipelined_scatter_reduce(nbytes, workers, bandwidth, latency)
    raise ValueError(f"algorithm: must be one of {', '.join(STORE_ALGORITHMS)}, got {algorithm!r}")


def sync_time(doc: dict) -> dict:
    """The `sync-time` command: JSON document in, `{"time_s": x}` out."""
    algorithm = v.choice(doc, "algorithm", STORE_ALGORITHMS)
    nbytes = v.number(doc, "bytes", positive=True)
    workers = v.integer(doc, "workers", minimum=1)
    bandwidth = v.number(doc, "bandwidth_bytes_per_s", positive=True)
    latency = v.number(doc, "latency_s", non_negative=True)
    return {"time_s": store_sync(algorithm, nbytes, workers, bandwidth, latency)}

"""Direct ring allreduce over torch.distributed (gloo on CPU, NCCL on CUDA), for targets
whose workers can reach each other (Hydrozoa's direct communication).

The store collectives (`comm.collectives`, `comm.scatter_reduce`) pass every byte
through a store; here the ranks open TCP connections to each other once per epoch and the
backend's ring moves the data: in a ring of n ranks each rank sends and receives
2 (n - 1) / n of the buffer (reduce-scatter, then all-gather), with no store traffic.

Rendezvous goes through the Zooid store, without Prefect:

1. rank 0 binds a listening socket on `host` (127.0.0.1 for local targets) with port 0,
   so the OS picks a free port at bind time (nothing can take it between choosing and
   binding), hands the socket to a `torch.distributed.TCPStore` and publishes
   `{"host", "port", "nonce"}` under `ring_address_key(group)` = `{group}/ring/addr`;
2. the other ranks wait for that key, connect to the TCPStore, and every rank builds the
   backend on a prefix store named by the nonce (so ranks of different generations never
   share rendezvous keys).

For Local-SGD `group` is the epoch's sync group (`runs/<id>/sync/e<epoch>`), which the
coordinator deletes before every attempt of an epoch and `release_group` deletes at its
end: a rank never finds an address left by an earlier attempt. If it still reads a stale
one (its server gone), the connection is refused and it reads the key again.

The backend is constructed directly (`ProcessGroupGloo` / `ProcessGroupNCCL` on the
TCPStore, as `init_process_group` does inside) rather than through
`init_process_group`: no process-global default group, so several rings can live in one
process (threads in tests, or a process in two groups), and closing one touches nothing
else.

Failure: a torch.distributed group cannot take a new member, so a relaunched rank cannot
rejoin its ring. With this collective a worker failure fails the epoch attempt; the
coordinator reruns the whole epoch and every rank resumes from the epoch's sync checkpoint
(`engine.local_sgd`). The survivors do not hang: a peer that dies breaks its connections
and the others raise `RingError` at once; a peer that never arrives or stops calling makes
them raise `RingTimeout` (a `StoreTimeout`: exit status 3) after `timeout` seconds.
"""
from __future__ import annotations

import datetime
import json
import secrets
import socket
import time
from typing import Callable

import torch
import torch.distributed as dist

from comm.bandwidth import TransferStats
from comm.collectives import PostLog
from comm.store import Store
from core.errors import StoreTimeout, ZooidError, ZooidValueError

LOOPBACK = "127.0.0.1"
CONNECT_S = 5.0
"""How long a rank tries one published address before reading the key again."""


class RingError(ZooidError):
    """The ring broke: a peer died or became unreachable during a collective."""


class RingTimeout(RingError, StoreTimeout):
    """A peer did not arrive at the rendezvous, or stopped calling, within the timeout."""


def ring_address_key(group: str) -> str:
    """Store key where rank 0 of the ring for `group` publishes its rendezvous address."""
    return f"{group}/ring/addr"


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) to allreduce `nbytes` in a ring of `world`."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def _own_address(host: str) -> str:
    """The address this rank's peers can reach it at: loopback stays loopback; `auto`
    and a wildcard resolve this machine's name."""
    if host in ("auto", "0.0.0.0", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


class RingGroup:
    """One ring of `world` ranks for one epoch: open with `open_ring`, call `allreduce_mean`
    or `allreduce_sum` any number of times, then `close` (also a context manager)."""

    def __init__(self, group: str, rank: int, world: int, timeout: float, device: torch.device,
                 backend=None, tcp_store=None):
        self.group, self.rank, self.world = group, rank, world
        self.timeout, self.device = timeout, device
        self._backend, self._tcp_store = backend, tcp_store
        self._broken: str | None = None

    @property
    def backend_name(self) -> str:
        """`gloo`, `nccl`, or `none` for a ring of one."""
        return "none" if self._backend is None else ("nccl" if self.device.type == "cuda" else "gloo")

    def allreduce_mean(self, tensors: dict[str, torch.Tensor], *, stats: TransferStats | None = None,
                       timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Elementwise mean of `tensors` over the ring (same names, shapes and dtypes on
        every rank), each dtype reduced in its own precision. world == 1 returns `tensors`."""
        return self.start_allreduce_mean(tensors, stats=stats, timeout=timeout).wait()

    def allreduce_sum(self, tensors: dict[str, torch.Tensor], *, stats: TransferStats | None = None,
                      timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Elementwise sum of `tensors` over the ring; otherwise as `allreduce_mean`."""
        return self._start(tensors, stats, timeout, mean=False).wait()

    def start_allreduce_mean(self, tensors: dict[str, torch.Tensor], *, stats: TransferStats | None = None,
                             timeout: float | None = None) -> "RingPending":
        """Launch the mean of `tensors` over the ring and return at once (the backend's
        async work); `wait()` on the result gives the means. The tensors are copied into
        the ring's buffers before this returns, so the caller may change them afterwards.
        Every rank must start its calls in the same order. world == 1: already done."""
        for name, t in tensors.items():
            if not t.is_floating_point():
                raise ZooidValueError("tensors", f"{name!r} is {t.dtype}; a mean needs floating tensors")
        return self._start(tensors, stats, timeout, mean=True)

    def _start(self, tensors: dict[str, torch.Tensor], stats: TransferStats | None,
               timeout: float | None, mean: bool) -> "RingPending":
        if self.world == 1:
            return RingPending(self, tensors, None, [], stats, 0.0, mean, 0.0)
        if self._backend is None:
            raise RingError(f"rank {self.rank}: the ring of {self.group} is "
                            f"{self._broken or 'closed'}; open a new one")
        began = time.perf_counter()
        buffers = _flatten(tensors, sorted(tensors), self.device)
        seconds = self.timeout if timeout is None else timeout
        try:
            # One call per dtype buffer, all in flight before the first wait.
            works = [self._backend.allreduce([buf], _sum_options(seconds)) for buf in buffers.values()]
        except RuntimeError as exc:
            self._fail(exc, seconds)
        return RingPending(self, tensors, buffers, works, stats, began, mean, seconds)

    def _fail(self, exc: RuntimeError, seconds: float) -> None:
        """Close the broken ring and raise the error a user can read."""
        timed_out = _is_timeout(exc)
        self._broken = "timed out" if timed_out else "broken"
        self.close()
        detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        what = (f"a peer did not reach the collective within {seconds:g}s" if timed_out
                else "a peer died or became unreachable")
        cls = RingTimeout if timed_out else RingError
        raise cls(f"rank {self.rank} of {self.world}: ring allreduce of {self.group} failed: {what} "
                  f"({detail}); a ring cannot take a relaunched rank, so the epoch attempt fails "
                  f"and is rerun from its sync checkpoint") from None

    def as_allreduce(self, op: str = "mean") -> Callable[..., dict[str, torch.Tensor]]:
        """This ring behind the store collectives' signature (`scatter_reduce.Allreduce`),
        so code written for those can use it. The store, prefix and the re-posting and
        replay options are ignored (nothing goes through the store), and so is `timeout`:
        the ring's own, set by `open_ring`, bounds every call. Rank and world must be the
        ring's."""
        if op not in ("mean", "sum"):
            raise ZooidValueError("op", f"must be 'mean' or 'sum', got {op!r}")
        reduce = self.allreduce_mean if op == "mean" else self.allreduce_sum

        def allreduce(store: Store, prefix: str, rank: int, world: int,
                      tensors: dict[str, torch.Tensor], timeout: float, *,
                      stats: TransferStats | None = None, previous_prefix: str | None = None,
                      log: PostLog | None = None, repost_s: float | None = None,
                      replay: bool = False, compressor=None) -> dict[str, torch.Tensor]:
            if compressor is not None and compressor.lossy:
                raise ZooidValueError("sync_dtype", "the direct ring moves tensors in their own dtype; "
                                      "compressed syncs go through the store (collective `store`)")
            if (rank, world) != (self.rank, self.world):
                raise ZooidValueError("rank", f"the ring was opened as rank {self.rank} of "
                                      f"{self.world}, called as {rank} of {world}")
            return reduce(tensors, stats=stats)

        return allreduce

    def close(self) -> None:
        """Shut the backend down and stop the rendezvous server (idempotent)."""
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.shutdown()
            except RuntimeError:
                pass  # already broken: nothing left to shut down
        self._tcp_store = None  # the server (rank 0) stops with its last reference

    def __enter__(self) -> "RingGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RingPending:
    """One allreduce launched on a ring (`RingGroup.start_allreduce_mean`); `wait` once."""

    def __init__(self, ring: RingGroup, tensors: dict[str, torch.Tensor],
                 buffers: dict[torch.dtype, torch.Tensor] | None, works: list, stats: TransferStats | None,
                 began: float, mean: bool, seconds: float):
        self.ring, self.tensors, self.buffers, self.works = ring, tensors, buffers, works
        self.stats, self.began, self.mean, self.seconds = stats, began, mean, seconds

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until the call is done; the reduced tensors by name. Counts the bytes and
        the seconds from launch to completion into the call's `stats`."""
        if self.buffers is None:
            return self.tensors
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as exc:
            self.ring._fail(exc, self.seconds)
        if self.mean:
            for buf in self.buffers.values():
                buf.div_(self.ring.world)
        out = _unflatten(self.buffers, self.tensors, sorted(self.tensors))
        stats = self.stats if self.stats is not None else TransferStats()
        sent = sum(ring_bytes(b.numel() * b.element_size(), self.ring.world) for b in self.buffers.values())
        stats.bytes_up += sent
        stats.bytes_down += sent
        stats.seconds += time.perf_counter() - self.began
        stats.calls += 1
        return out


def open_ring(store: Store, group: str, rank: int, world: int, timeout: float, *,
              host: str = LOOPBACK, device: torch.device | str = "cpu") -> RingGroup:
    """Open the ring of `world` ranks for `group` (see the module docstring); every rank
    calls it with the same `group`, `world` and `host`. `host` is where rank 0 listens:
    127.0.0.1 for local targets, or an address of rank 0's machine, or `auto` (listen on
    every interface, publish this machine's resolved address). `device` picks the backend:
    gloo on CPU, NCCL on CUDA. Raises `RingTimeout` when the ring is not complete within
    `timeout` seconds."""
    if not isinstance(world, int) or world < 1:
        raise ZooidValueError("world", f"must be a positive integer, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ZooidValueError("rank", f"must be in 0..{world - 1}, got {rank!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ZooidValueError("timeout", f"must be seconds > 0, got {timeout!r}")
    if not isinstance(host, str):
        raise ZooidValueError("sync.ring_host", f"must be an address string, got {host!r}")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ZooidValueError("device", f"the ring runs on cpu (gloo) or cuda (nccl), got {device}")
    if world == 1:
        return RingGroup(group, rank, world, timeout, device)
    limit = datetime.timedelta(seconds=timeout)
    try:
        if rank == 0:
            tcp_store, nonce = _host_rendezvous(store, group, world, host, limit)
        else:
            tcp_store, nonce = _join_rendezvous(store, group, rank, world, timeout)
        prefixed = dist.PrefixStore(f"zooid-ring/{nonce}", tcp_store)
        backend = _build_backend(prefixed, rank, world, limit, device, host)
    except RuntimeError as exc:  # torch's DistStoreError and friends
        kind = "timed out" if _is_timeout(exc) else "failed"
        raise RingTimeout(f"rank {rank} of {world}: ring rendezvous of {group} {kind} after "
                          f"{timeout:g}s; a peer is missing or unreachable "
                          f"({str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__})") from None
    return RingGroup(group, rank, world, timeout, device, backend, tcp_store)


def _host_rendezvous(store: Store, group: str, world: int, host: str, limit: datetime.timedelta):
    """Rank 0: listen on a port the OS picks, host the TCPStore there, publish the address."""
    bind = "0.0.0.0" if host == "auto" else host
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((bind, 0))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise ZooidValueError("sync.ring_host", f"cannot listen on {bind!r}: {exc}") from None
    port = listener.getsockname()[1]
    # The TCPStore server takes the descriptor over (and closes it when it stops).
    tcp_store = dist.TCPStore(bind, port, world, True, timeout=limit, wait_for_workers=False,
                              master_listen_fd=listener.detach())
    nonce = secrets.token_hex(8)
    address = {"host": _own_address(host), "port": port, "nonce": nonce}
    store.put(ring_address_key(group), json.dumps(address).encode())
    return tcp_store, nonce


def _join_rendezvous(store: Store, group: str, rank: int, world: int, timeout: float):
    """Rank > 0: read rank 0's address and connect; read it again if that address is dead
    (left by an earlier attempt) until `timeout`."""
    key = ring_address_key(group)
    deadline = time.monotonic() + timeout
    last_error = "no address published"
    while True:
        left = deadline - time.monotonic()
        try:
            address = json.loads(store.get(key, timeout=max(0.0, left)))
        except (StoreTimeout, KeyError):
            raise RingTimeout(f"rank {rank} of {world}: waited {timeout:g}s for {key}; "
                              f"rank 0 of the ring is missing ({last_error})") from None
        host, port = address["host"], int(address["port"])
        # A plain connect first: a dead address is refused at once, where TCPStore would
        # retry it for its whole timeout.
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(CONNECT_S, left))).close()
        except OSError as exc:
            last_error = f"{host}:{port} unreachable: {exc}"
            if time.monotonic() >= deadline:
                raise RingTimeout(f"rank {rank} of {world}: could not reach rank 0 of the ring "
                                  f"within {timeout:g}s ({last_error})") from None
            time.sleep(0.2)  # rank 0 of this attempt may not have published yet
            continue
        left = max(0.1, deadline - time.monotonic())
        tcp_store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=left))
        return tcp_store, address["nonce"]


def _build_backend(prefixed, rank: int, world: int, limit: datetime.timedelta,
                   device: torch.device, host: str):
    """The backend on the rendezvous store, built as `init_process_group` builds it."""
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ZooidValueError("device", "CUDA tensors need NCCL, which this torch lacks")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = limit
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = limit
    # Each rank listens for its peers on its own address: loopback for local targets.
    gloo_host = LOOPBACK if host == LOOPBACK else _own_address("auto")
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)]
    return dist.ProcessGroupGloo(prefixed, rank, world, options)


def ring_allreduce_mean(ring: RingGroup, tensors: dict[str, torch.Tensor], *,
                        stats: TransferStats | None = None) -> dict[str, torch.Tensor]:
    """Elementwise mean of `tensors` over `ring` (see `RingGroup.allreduce_mean`)."""
    return ring.allreduce_mean(tensors, stats=stats)


def _sum_options(seconds: float):
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    # Per call: the backend's own timeout only bounds calls that do not set one.
    options.timeout = datetime.timedelta(seconds=seconds)
    return options


def _flatten(tensors: dict[str, torch.Tensor], names: list[str], device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    """One contiguous buffer per dtype on the ring's device, tensors in `names` order."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in names:
        t = tensors[name]
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1).to(device))
    # torch.cat copies, so reducing in place never touches the caller's tensors.
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


def _unflatten(buffers: dict[torch.dtype, torch.Tensor], like: dict[str, torch.Tensor],
               names: list[str]) -> dict[str, torch.Tensor]:
    offsets = dict.fromkeys(buffers, 0)
    out = {}
    for name in names:
        t = like[name]
        start = offsets[t.dtype]
        out[name] = buffers[t.dtype][start:start + t.numel()].reshape(t.shape).to(t.device).clone()
        offsets[t.dtype] = start + t.numel()
    return out

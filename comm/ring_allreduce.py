"""Direct ring allreduce between the workers (Hydrozoa's direct communication), for targets
whose workers can reach each other: over plain TCP connections on CPU (`comm.socket_ring`),
over NCCL on CUDA.

The store collectives (`comm.collectives`, `comm.scatter_reduce`) pass every byte
through a store; here the ranks connect to each other once per epoch and the ring moves the
data: in a ring of n ranks each rank sends and receives 2 (n - 1) / n of the buffer
(reduce-scatter, then all-gather), with no store traffic.

Rendezvous goes through the Zooid store, without Prefect:

1. rank 0 binds a listening socket on `host` (127.0.0.1 for local targets) with port 0,
   so the OS picks a free port at bind time (nothing can take it between choosing and
   binding), and publishes `{"host", "port", "nonce"}` under `ring_address_key(group)` =
   `{group}/ring/addr`;
2. the other ranks wait for that key and connect. On CPU they join at rank 0 with the
   nonce and learn each other's addresses (`comm.socket_ring`); on CUDA rank 0's socket
   hosts a `torch.distributed.TCPStore` and NCCL is built on a prefix store named by the
   nonce. Either way ranks of different generations never meet.

For Local-SGD `group` is the epoch's sync group (`runs/<id>/sync/e<epoch>`), which the
coordinator deletes before every attempt of an epoch and `release_group` deletes at its
end: a rank never finds an address left by an earlier attempt. If it still reads a stale
one (its server gone), the connection is refused and it reads the key again.

Asynchronous calls (`start_allreduce_mean`, the gradient buckets' way): on CPU a call runs
on one daemon thread per ring, in the order started, unless the caller says `now` (the
last bucket of a step: nothing is left to overlap with it, and a hand-off between threads
would cost more than a small bucket's transfer); on CUDA NCCL's stream runs it. NCCL's
backend is constructed directly rather than through `init_process_group`: no process-global
default group, so several rings can live in one process, and closing one touches nothing
else.

Failure: a ring cannot take a new member, so a relaunched rank cannot rejoin its ring.
With this collective a worker failure fails the epoch attempt; the coordinator reruns the
whole epoch and every rank resumes from the epoch's sync checkpoint (`engine.local_sgd`).
The survivors do not hang: a peer that dies breaks its connections and the others raise
`RingError` at once; a peer that never arrives or stops calling makes them raise
`RingTimeout` (a `StoreTimeout`: exit status 3) after `timeout` seconds.
"""
from __future__ import annotations

import datetime
import json
import queue
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch
import torch.distributed as dist

from comm import socket_ring
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
    or `allreduce_sum` any number of times, then `close` (also a context manager). `links`:
    the CPU ring's connections; `backend`: NCCL's process group (CUDA); neither for a ring
    of one."""

    def __init__(self, group: str, rank: int, world: int, timeout: float, device: torch.device,
                 backend=None, tcp_store=None, links: socket_ring.Links | None = None):
        self.group, self.rank, self.world = group, rank, world
        self.timeout, self.device = timeout, device
        self._backend, self._tcp_store, self._links = backend, tcp_store, links
        self._mover: _Mover | None = None
        self._broken: str | None = None
        self.backend_name = "tcp" if links is not None else "nccl" if backend is not None else "none"
        """`tcp` (CPU), `nccl` (CUDA), or `none` for a ring of one."""

    def allreduce_mean(self, tensors: dict[str, torch.Tensor], *, stats: TransferStats | None = None,
                       timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Elementwise mean of `tensors` over the ring (same names, shapes and dtypes on
        every rank), each dtype reduced in its own precision. world == 1 returns `tensors`."""
        return self.start_allreduce_mean(tensors, stats=stats, timeout=timeout, now=True).wait()

    def allreduce_sum(self, tensors: dict[str, torch.Tensor], *, stats: TransferStats | None = None,
                      timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Elementwise sum of `tensors` over the ring; otherwise as `allreduce_mean`."""
        return self._start(tensors, stats, timeout, mean=False, now=True).wait()

    def start_allreduce_mean(self, tensors: dict[str, torch.Tensor], *, stats: TransferStats | None = None,
                             timeout: float | None = None, now: bool = False) -> "RingPending":
        """Launch the mean of `tensors` over the ring and return at once (see the module
        docstring; `now`: run it on this thread before returning); `wait()` on the result
        gives the means. The tensors are copied into the ring's buffers before this returns,
        so the caller may change them afterwards. Every rank must start its calls in the same
        order. world == 1: already done."""
        for name, t in tensors.items():
            if not t.is_floating_point():
                raise ZooidValueError("tensors", f"{name!r} is {t.dtype}; a mean needs floating tensors")
        return self._start(tensors, stats, timeout, mean=True, now=now)

    def _start(self, tensors: dict[str, torch.Tensor], stats: TransferStats | None,
               timeout: float | None, mean: bool, now: bool) -> "RingPending":
        if self.world == 1:
            return RingPending(self, tensors, None, None, stats, 0.0, mean, 0.0)
        if self._backend is None and self._links is None:
            raise RingError(f"rank {self.rank}: the ring of {self.group} is "
                            f"{self._broken or 'closed'}; open a new one")
        began = time.perf_counter()
        buffers = _flatten(tensors, sorted(tensors), self.device)
        seconds = self.timeout if timeout is None else timeout
        if self._links is not None:
            links = self._links

            def move() -> None:
                deadline = time.monotonic() + seconds
                for buf in buffers.values():
                    socket_ring.allreduce_sum(links, self.rank, self.world, buf, deadline)

            if self._mover is None and not now:
                self._mover = _Mover(f"ring-{self.group}-r{self.rank}")
            work = self._mover.run(move, now) if self._mover is not None else _ran(move)
            return RingPending(self, tensors, buffers, work, stats, began, mean, seconds)
        try:
            # One call per dtype buffer, all in flight before the first wait.
            works = [self._backend.allreduce([buf], _sum_options(seconds)) for buf in buffers.values()]
        except RuntimeError as exc:
            self._fail(exc, seconds)
        return RingPending(self, tensors, buffers, _NcclWorks(works), stats, began, mean, seconds)

    def sum_in_place(self, buf: torch.Tensor, timeout: float | None = None) -> None:
        """Sum one contiguous 1-d CPU buffer over the ring in place: the transport alone,
        without the copies in and out that `allreduce_sum` makes (a benchmark's way in)."""
        if self._links is None:
            raise RingError(f"rank {self.rank}: sum_in_place needs an open CPU ring of two or more")
        seconds = self.timeout if timeout is None else timeout
        try:
            socket_ring.allreduce_sum(self._links, self.rank, self.world, buf, time.monotonic() + seconds)
        except (socket_ring.RingPeerLost, socket_ring.RingDeadline) as exc:
            self._fail(exc, seconds)

    def _fail(self, exc: BaseException, seconds: float) -> None:
        """Close the broken ring and raise the error a user can read."""
        timed_out = isinstance(exc, socket_ring.RingDeadline) or (
            isinstance(exc, RuntimeError) and _is_timeout(exc))
        self.close()
        self._broken = "timed out" if timed_out else "broken"
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
        """Close the connections (or shut the backend down) and stop the rendezvous server
        (idempotent)."""
        links, self._links = self._links, None
        if links is not None:
            links.close()  # a call still moving bytes on the mover fails at once
        if self._mover is not None:
            self._mover.stop()
            self._mover = None
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


class _Mover:
    """The daemon thread that runs a CPU ring's calls in the order they were started (a
    daemon, so a call stuck on a dead peer never keeps a failing worker from exiting)."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Future | None = None
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            move, done = item
            try:
                move()
                done.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait() in the caller's thread
                done.set_exception(exc)

    def run(self, move: Callable[[], None], now: bool) -> Future:
        """Queue `move` behind the calls started before; `now`: wait for those, then run it
        on this thread."""
        if now:
            if self._last is not None:
                self._last.exception()  # done (a failure there is raised by its own wait)
            return _ran(move)
        done: Future = Future()
        self._queue.put((move, done))
        self._last = done
        return done

    def stop(self) -> None:
        self._queue.put(None)


def _ran(move: Callable[[], None]) -> Future:
    """`move` run on this thread, as a finished future."""
    done: Future = Future()
    try:
        move()
        done.set_result(None)
    except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
        done.set_exception(exc)
    return done


class _NcclWorks:
    """NCCL's works of one call behind a future's `result()`."""

    def __init__(self, works: list):
        self.works = works

    def result(self) -> None:
        for work in self.works:
            work.wait()


class RingPending:
    """One allreduce launched on a ring (`RingGroup.start_allreduce_mean`); `wait` once."""

    def __init__(self, ring: RingGroup, tensors: dict[str, torch.Tensor],
                 buffers: dict[torch.dtype, torch.Tensor] | None, work, stats: TransferStats | None,
                 began: float, mean: bool, seconds: float):
        self.ring, self.tensors, self.buffers, self.work = ring, tensors, buffers, work
        self.stats, self.began, self.mean, self.seconds = stats, began, mean, seconds

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until the call is done; the reduced tensors by name. Counts the bytes and
        the seconds from launch to completion into the call's `stats`."""
        if self.buffers is None:
            return self.tensors
        try:
            self.work.result()
        except (RuntimeError, OSError, socket_ring.RingPeerLost, socket_ring.RingDeadline) as exc:  # NCCL's; the CPU ring's
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
    every interface, publish this machine's resolved address). `device` picks the transport:
    TCP connections on cpu, NCCL on cuda. Raises `RingTimeout` when the ring is not complete
    within `timeout` seconds."""
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
        raise ZooidValueError("device", f"the ring runs on cpu (tcp) or cuda (nccl), got {device}")
    if world == 1:
        return RingGroup(group, rank, world, timeout, device)
    if device.type == "cpu":
        return _open_cpu_ring(store, group, rank, world, timeout, host, device)
    limit = datetime.timedelta(seconds=timeout)
    try:
        if rank == 0:
            tcp_store, nonce = _host_rendezvous(store, group, world, host, limit)
        else:
            tcp_store, nonce = _join_rendezvous(store, group, rank, world, timeout)
        prefixed = dist.PrefixStore(f"zooid-ring/{nonce}", tcp_store)
        backend = _build_nccl(prefixed, rank, world, limit)
    except RuntimeError as exc:  # torch's DistStoreError and friends
        raise _rendezvous_failed(rank, world, group, timeout, exc) from None
    return RingGroup(group, rank, world, timeout, device, backend, tcp_store)


def _rendezvous_failed(rank: int, world: int, group: str, timeout: float, exc: BaseException) -> RingTimeout:
    kind = "timed out" if isinstance(exc, socket_ring.RingDeadline) or _is_timeout(exc) else "failed"
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return RingTimeout(f"rank {rank} of {world}: ring rendezvous of {group} {kind} after "
                       f"{timeout:g}s; a peer is missing or unreachable ({detail})")


def _listen(host: str) -> socket.socket:
    """Rank 0's listening socket on `host` (`auto`: every interface), on a port the OS picks."""
    bind = "0.0.0.0" if host == "auto" else host
    try:
        return socket_ring.listen(bind)
    except OSError as exc:
        raise ZooidValueError("sync.ring_host", f"cannot listen on {bind!r}: {exc}") from None


def _publish(store: Store, group: str, host: str, port: int) -> str:
    """Rank 0's address and a fresh nonce under the group's address key; the nonce."""
    nonce = secrets.token_hex(8)
    store.put(ring_address_key(group), json.dumps({"host": _own_address(host), "port": port,
                                                   "nonce": nonce}).encode())
    return nonce


def _open_cpu_ring(store: Store, group: str, rank: int, world: int, timeout: float, host: str,
                   device: torch.device) -> RingGroup:
    """The CPU ring's rendezvous and connections (`comm.socket_ring`)."""
    deadline = time.monotonic() + timeout
    listener = _listen(host)
    own = (_own_address(host), listener.getsockname()[1])
    try:
        if rank == 0:
            nonce = _publish(store, group, host, own[1])
            links = socket_ring.host_links(listener, own, nonce, world, deadline)
        else:
            links = _join_cpu_ring(store, group, rank, world, timeout, listener, own, deadline)
    except (socket_ring.RingDeadline, socket_ring.RingPeerLost, OSError) as exc:
        raise _rendezvous_failed(rank, world, group, timeout, exc) from None
    finally:
        listener.close()
    return RingGroup(group, rank, world, timeout, device, links=links)


def _join_cpu_ring(store: Store, group: str, rank: int, world: int, timeout: float,
                   listener: socket.socket, own: tuple[str, int], deadline: float) -> socket_ring.Links:
    """Rank > 0 on CPU: join at rank 0 and link (`comm.socket_ring`), through `_reach_rank0`."""
    return _reach_rank0(store, group, rank, world, timeout, deadline,
                        lambda host, port, nonce: socket_ring.join_links((host, port), listener, own, nonce,
                                                                         rank, world, deadline))


def _reach_rank0(store: Store, group: str, rank: int, world: int, timeout: float, deadline: float, attempt):
    """Rank > 0: read rank 0's address and return `attempt(host, port, nonce)`; read it again
    while that address is dead (left by an earlier attempt: `OSError`) or answers with another
    nonce (`RingPeerLost`), until the deadline."""
    last_error = "no address published"
    while True:
        address = _read_address(store, group, rank, world, timeout, deadline, last_error)
        host, port = address["host"], int(address["port"])
        try:
            return attempt(host, port, address["nonce"])
        except (OSError, socket_ring.RingPeerLost) as exc:
            last_error = f"{host}:{port} unreachable: {exc}"
            if time.monotonic() >= deadline:
                raise RingTimeout(f"rank {rank} of {world}: could not reach rank 0 of the ring "
                                  f"within {timeout:g}s ({last_error})") from None
            time.sleep(0.2)  # rank 0 of this attempt may not have published yet


def _read_address(store: Store, group: str, rank: int, world: int, timeout: float, deadline: float,
                  last_error: str) -> dict:
    key = ring_address_key(group)
    try:
        return json.loads(store.get(key, timeout=max(0.0, deadline - time.monotonic())))
    except (StoreTimeout, KeyError):
        raise RingTimeout(f"rank {rank} of {world}: waited {timeout:g}s for {key}; "
                          f"rank 0 of the ring is missing ({last_error})") from None


def _host_rendezvous(store: Store, group: str, world: int, host: str, limit: datetime.timedelta):
    """Rank 0 on CUDA: listen on a port the OS picks, host the TCPStore there, publish the address."""
    listener = _listen(host)
    bind, port = listener.getsockname()
    # The TCPStore server takes the descriptor over (and closes it when it stops).
    tcp_store = dist.TCPStore(bind, port, world, True, timeout=limit, wait_for_workers=False,
                              master_listen_fd=listener.detach())
    return tcp_store, _publish(store, group, host, port)


def _join_rendezvous(store: Store, group: str, rank: int, world: int, timeout: float):
    """Rank > 0 on CUDA: connect to rank 0's TCPStore, through `_reach_rank0`."""
    deadline = time.monotonic() + timeout

    def attempt(host: str, port: int, nonce: str):
        # A plain connect first: a dead address is refused at once, where TCPStore would
        # retry it for its whole timeout.
        left = deadline - time.monotonic()
        socket.create_connection((host, port), timeout=max(0.1, min(CONNECT_S, left))).close()
        left = max(0.1, deadline - time.monotonic())
        return dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=left)), nonce

    return _reach_rank0(store, group, rank, world, timeout, deadline, attempt)


def _build_nccl(prefixed, rank: int, world: int, limit: datetime.timedelta):
    """NCCL's backend on the rendezvous store, built as `init_process_group` builds it."""
    if not dist.is_nccl_available():
        raise ZooidValueError("device", "CUDA tensors need NCCL, which this torch lacks")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = limit
    return dist.ProcessGroupNCCL(prefixed, rank, world, options)


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
        out[name] = buffers[t.dtype][start:start + t.numel()].reshape(t.shape).to(t.device)  # a view: the buffer is this call's own
        offsets[t.dtype] = start + t.numel()
    return out

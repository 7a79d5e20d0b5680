"""The CPU ring's transport: a ring allreduce over plain TCP connections between the ranks.

Why not gloo: measured on the 2-core machine this project is developed on, one gloo
allreduce between two processes took 1.2-2.2 ms at 4 KB, while this transport, one thread
sending and receiving with `selectors`, took 0.07-0.13 ms up to 153 KB (`benchmarks/bench_ring.py`,
`BENCHMARKS.md`). A data-parallel
step of a small model syncs in less time than gloo's hand-offs between its own threads take;
this transport has none: the calling thread moves the bytes.

Shape: rank r sends to rank r + 1 and receives from rank r - 1 (mod world), each over its own
connection. An allreduce of a flat buffer cut into `world` chunks is a reduce-scatter (world -
1 hops: send one chunk, receive the previous rank's partial sum of the next, add) and an
all-gather (world - 1 hops: pass the reduced chunks on), so each rank sends and receives 2
(world - 1) / world of the buffer. Each chunk is summed once, by one chain of ranks in a fixed
order, and then copied: every rank ends with the same bits.

Connecting (`host_links` on rank 0, `join_links` on the others), given an address published
through the Zooid store by rank 0:

1. every rank listens on a port the OS picks; rank 0 publishes its address and a nonce;
2. each other rank connects to rank 0 and says `join` with the nonce, its rank and its own
   address; once all have joined, rank 0 answers each with every rank's address;
3. each rank connects to its successor and says `link` with the nonce and its rank, and
   accepts its predecessor's `link`. A connection with the wrong nonce or an unexpected rank
   is closed and not counted, so a rank of another attempt cannot join this ring.

Failures: a peer that dies closes its connections (the kernel does, whatever killed it), so
a survivor's next send or receive fails at once (`RingPeerLost`); a peer that is alive but
does not call makes the call wait until its deadline (`RingDeadline`). Either leaves the ring
unusable: the caller closes it.
"""
from __future__ import annotations

import json
import selectors
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable

import torch

from core.errors import ZooidError

_FRAME = struct.Struct("!I")
MAX_HELLO = 1 << 16
"""The largest rendezvous message accepted (addresses of every rank, as JSON)."""


class RingPeerLost(ZooidError):
    """A neighbour closed its connection or became unreachable."""


class RingDeadline(ZooidError):
    """A neighbour did not send or take the bytes of a call before its deadline."""


@dataclass
class Links:
    """One rank's two connections: to its successor and from its predecessor."""

    send: socket.socket
    recv: socket.socket

    def close(self) -> None:
        for s in {self.send, self.recv}:
            try:
                s.close()
            except OSError:
                pass


def listen(bind: str) -> socket.socket:
    """A listening socket on `bind`, on a port the OS picks."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((bind, 0))
    listener.listen(128)
    return listener


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise RingDeadline("the deadline passed")
    return left


def send_message(conn: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    conn.sendall(_FRAME.pack(len(body)) + body)


def read_message(conn: socket.socket, deadline: float) -> dict:
    """One framed JSON message from `conn` before `deadline` (monotonic)."""
    head = _read_exact(conn, _FRAME.size, deadline)
    (size,) = _FRAME.unpack(head)
    if size > MAX_HELLO:
        raise RingPeerLost(f"a rendezvous message of {size} bytes")
    return json.loads(_read_exact(conn, size, deadline))


def _read_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        conn.settimeout(_left(deadline))
        try:
            chunk = conn.recv(n - len(out))
        except socket.timeout:
            raise RingDeadline("the deadline passed") from None
        if not chunk:
            raise RingPeerLost("the connection closed during the rendezvous")
        out += chunk
    return bytes(out)


def _tune(conn: socket.socket) -> socket.socket:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def accept_from(listener: socket.socket, deadline: float, want) -> tuple[socket.socket, dict]:
    """Accept connections until one says a message `want(message)` accepts; close the rest."""
    while True:
        listener.settimeout(_left(deadline))
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            raise RingDeadline("the deadline passed") from None
        try:
            message = read_message(conn, min(deadline, time.monotonic() + 5.0))
        except (OSError, ValueError, RingDeadline):
            conn.close()
            continue
        if want(message):
            conn.settimeout(None)
            return _tune(conn), message
        conn.close()


def connect(address: tuple[str, int], deadline: float) -> socket.socket:
    conn = socket.create_connection(address, timeout=min(5.0, _left(deadline)))
    conn.settimeout(None)
    return _tune(conn)


def host_links(listener: socket.socket, own: tuple[str, int], nonce: str, world: int,
               deadline: float) -> Links:
    """Rank 0 of the rendezvous (step 2 and 3 of the module docstring)."""
    joined: dict[int, tuple[socket.socket, list]] = {}
    try:
        while len(joined) < world - 1:
            conn, hello = accept_from(listener, deadline, lambda m: m.get("op") == "join" and m.get("nonce") == nonce
                                      and isinstance(m.get("rank"), int) and 0 < m["rank"] < world)
            if hello["rank"] in joined:  # the same rank again (it retried): the newer one counts
                joined[hello["rank"]][0].close()
            joined[hello["rank"]] = (conn, hello["address"])
        addresses = [list(own)] + [joined[r][1] for r in range(1, world)]
        for conn, _ in joined.values():
            send_message(conn, {"addresses": addresses})
    finally:
        for conn, _ in joined.values():
            conn.close()
    return _link(listener, addresses, 0, world, nonce, deadline)


def join_links(rank0: tuple[str, int], listener: socket.socket, own: tuple[str, int], nonce: str,
               rank: int, world: int, deadline: float) -> Links:
    """A rank > 0: join at rank 0 (step 2 of the module docstring), then link (step 3)."""
    conn = connect(rank0, deadline)
    try:
        send_message(conn, {"op": "join", "nonce": nonce, "rank": rank, "address": list(own)})
        addresses = read_message(conn, deadline)["addresses"]
    finally:
        conn.close()
    return _link(listener, addresses, rank, world, nonce, deadline)


def _link(listener: socket.socket, addresses: list, rank: int, world: int, nonce: str, deadline: float) -> Links:
    """Connect to the successor, accept the predecessor (step 3)."""
    succ, pred = (rank + 1) % world, (rank - 1) % world
    send = connect(tuple(addresses[succ]), deadline)
    try:
        send_message(send, {"op": "link", "nonce": nonce, "rank": rank})
        recv, _ = accept_from(listener, deadline, lambda m: m.get("op") == "link" and m.get("nonce") == nonce
                              and m.get("rank") == pred)
    except BaseException:
        send.close()
        raise
    return Links(send, recv)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def exchange(links: Links, out: torch.Tensor, into: torch.Tensor, deadline: float,
             arrived: Callable[[int, int], None] | None = None) -> None:
    """Send `out` to the successor while receiving `into` from the predecessor (contiguous
    tensors), both done before `deadline`; raises RingPeerLost or RingDeadline.
    `arrived(a, b)`: elements a..b of `into` have arrived (called in order, each element
    once), so the caller can use them while the rest is still on its way."""
    try:
        _exchange(links, _bytes(out), _bytes(into), deadline, arrived, into.element_size())
    except (OSError, ValueError) as exc:  # a connection reset or closed (by `Links.close` too)
        raise RingPeerLost(f"{type(exc).__name__}: {exc}") from None


ABSORB_BYTES = 256 * 2**10
"""Bytes received before `exchange` hands them to `arrived` (fewer calls for small pieces)."""


def _exchange(links: Links, tx: memoryview, rx: memoryview, deadline: float,
              arrived: Callable[[int, int], None] | None, item: int) -> None:
    sent = got = used = 0
    with selectors.DefaultSelector() as sel:
        if len(tx):
            links.send.setblocking(False)
            sel.register(links.send, selectors.EVENT_WRITE)
        if len(rx):
            links.recv.setblocking(False)
            sel.register(links.recv, selectors.EVENT_READ)
        try:
            while sent < len(tx) or got < len(rx):
                ready = sel.select(timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise RingDeadline("the deadline passed")
                for key, ev in ready:
                    if ev & selectors.EVENT_WRITE:
                        try:
                            sent += links.send.send(tx[sent:])
                        except BlockingIOError:
                            continue
                        if sent >= len(tx):
                            sel.unregister(links.send)
                    elif ev & selectors.EVENT_READ:
                        try:
                            n = links.recv.recv_into(rx[got:])
                        except BlockingIOError:
                            continue
                        if n == 0:
                            raise RingPeerLost("the predecessor closed its connection")
                        got += n
                        if got >= len(rx):
                            sel.unregister(links.recv)
                        if arrived is not None and (got - used >= ABSORB_BYTES or got >= len(rx)):
                            whole = got // item
                            arrived(used // item, whole)
                            used = whole * item
        finally:
            for sock in (links.send, links.recv):
                if sock.fileno() >= 0:
                    sock.setblocking(True)


def allreduce_sum(links: Links, rank: int, world: int, buf: torch.Tensor, deadline: float) -> None:
    """Sum the contiguous 1-d `buf` over the ring in place (see the module docstring)."""
    chunks = torch.tensor_split(buf, world)
    scratch = torch.empty_like(chunks[0])
    for hop in range(world - 1):  # reduce-scatter: rank r ends holding the sum of chunk r + 1
        send_c, recv_c = chunks[(rank - hop) % world], chunks[(rank - hop - 1) % world]
        into = scratch[:recv_c.numel()]
        exchange(links, send_c, into, deadline,
                 lambda a, b, into=into, recv_c=recv_c: recv_c[a:b].add_(into[a:b]))
    for hop in range(world - 1):  # all-gather: pass the reduced chunks round
        exchange(links, chunks[(rank + 1 - hop) % world], chunks[(rank - hop) % world], deadline)

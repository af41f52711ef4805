"""``listen``/``connect``: endpoints without ranks, for client/server pipelines.

A connection is a UCX endpoint created from a socket address (UCX's listener/connect,
with UCX peer error handling on). Right after it is established both sides exchange, over
the UCX stream API, the 32-bit namespace under which they receive, an identity of their
host (boot id and network/IPC namespaces) and their worker address; tags on the
connection are then ``namespace << 32 | user tag``, so connections sharing a worker never
match each other's messages. When the peer goes away, UCX closes the endpoint and its
pending operations fail with :class:`~ucxcomm.PeerFailure`.

Peers on the same host (same identity) then send their messages through a second
endpoint created from the peer's worker address, without UCX error handling: UCX keeps
endpoints with error handling on TCP, while this one uses shared memory and CMA (DESIGN:
failure detection must not cost shared memory). The socket-address endpoint stays open
for failure detection. A tag message each way over the new path finishes its wire-up
before the connection is handed out (UCX aborts a process whose peer dies while an
endpoint is still being set up, see rma.RemoteMemory.wireup).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import struct
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import ClosedError, CommTimeoutError, PeerFailure, UcxCommError
from . import _ucx
from .base import FULL_MASK
from .endpoint import _HELLO_TAG, Endpoint
from .worker import Worker

__all__ = ["Listener", "connect", "default_worker", "listen"]

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<IHH")  # namespace, host identity length, worker address length
_workers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Worker] = \
    weakref.WeakKeyDictionary()
_conn_ids = itertools.count(1)


def default_worker() -> Worker:
    """The worker ``listen``/``connect`` use on the running event loop (created lazily;
    released when the loop's tasks are cancelled at shutdown, e.g. by ``asyncio.run``)."""
    loop = asyncio.get_running_loop()
    worker = _workers.get(loop)
    if worker is None or worker.closed:
        worker = _workers[loop] = Worker()
    return worker


def _check_args(port: Any, timeout: Any, lowest: int, what: str) -> None:
    """Bad ``port``/``timeout`` arguments raise at the call, before any I/O."""
    if isinstance(port, bool) or not isinstance(port, int) or not lowest <= port <= 65535:
        raise ValueError(f"{what}: port must be an int in [{lowest}, 65535], got {port!r}")
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        raise ValueError(f"{what}: timeout must be a number of seconds > 0 or None, got "
                         f"{timeout!r}")


def host_identity() -> bytes:
    """What two processes share when they can reach each other's shared memory: the
    kernel's boot id and the network and IPC namespaces (empty when unknown: never
    treated as the same host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        net, ipc = (os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("net", "ipc"))
    except OSError:
        return b""
    return boot + f":{net}:{ipc}".encode()


def _new_namespace(worker: Worker) -> int:
    taken = worker.__dict__.setdefault("_namespaces", set())
    while True:
        ns = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        if ns and ns not in taken:
            taken.add(ns)
            return ns


async def _handshake(worker: Worker, ucx_ep: Any, timeout: float | None,
                     keep: Any = None) -> Endpoint:
    label = ("connection", next(_conn_ids))
    ep = worker.adopt(ucx_ep, label)
    ep._keep = keep

    def closed_by_peer() -> None:
        if not ep.closed:
            log.info("connection %s closed by its peer", label[1])
            worker.fail_peer(label, PeerFailure("the connection was closed by its peer",
                                                peer=None))

    ucx_ep.set_close_callback(closed_by_peer)
    mine = _new_namespace(worker)
    host, address = host_identity(), worker.address
    hello = _HELLO.pack(mine, len(host), len(address)) + host + address
    head = bytearray(_HELLO.size)
    peers = frozenset((label,))

    async def both(*futs: Any) -> None:
        pending = [f for f in futs if f is not None]
        worker.wake()
        results = await asyncio.gather(*pending, return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res

    sent: asyncio.Future | None = None
    try:
        async with asyncio.timeout(timeout):
            sent = worker.stream_send(ep._handle, worker.send_ptr(hello), peers)
            await both(worker.stream_recv(ep._handle, worker.recv_ptr(head), peers))
            theirs, hlen, alen = _HELLO.unpack(head)
            rest = bytearray(hlen + alen)
            await both(sent, worker.stream_recv(ep._handle, worker.recv_ptr(rest), peers))
            if host and rest[:hlen] == host:
                try:
                    ep.use_data_path(worker.raw_endpoint(bytes(rest[hlen:])))
                except UcxCommError as exc:  # keep the first endpoint
                    log.info("connection %s: no direct path on this host (%s)", label[1],
                             exc)
            # One message each way on the path that will carry the traffic.
            check = bytearray(1)
            got: Any = worker.recv_into(worker.recv_ptr(check), (mine << 32) | _HELLO_TAG,
                                        FULL_MASK, peers)
            await both(ep.isend(b"\x01", (theirs << 32) | _HELLO_TAG),
                       got if type(got) is not tuple else None)
    except TimeoutError:
        _forget(sent)
        ep.abort()
        raise CommTimeoutError(f"connection handshake took longer than {timeout:g} s") \
            from None
    except BaseException:
        _forget(sent)
        ep.abort()
        raise
    ep._recv_ns, ep._send_ns = mine, theirs
    return ep


def _forget(fut: asyncio.Future | None) -> None:
    """The handshake failed before awaiting ``fut`` (our hello, which fails too once
    the connection is refused): its outcome is known from the failure that ended the
    handshake, so retrieve it, now or when it ends (no "Future exception was never
    retrieved")."""
    if fut is None:
        return
    if fut.done():
        if not fut.cancelled():
            fut.exception()
    else:
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())


class Listener:
    """Accepts connections and runs ``handler(endpoint)`` for each, as a task.

    Use :func:`listen` to create one. ``port`` is the bound port; ``await close()``
    (or leaving ``async with``) stops accepting: established connections stay open.
    The port is released once the listener is closed and no connection it accepted is
    open any more (UCX keeps a listener while endpoints it accepted exist); until then
    new connection attempts are turned away at once.
    """

    def __init__(self, worker: Worker, handler: Callable[[Endpoint], Awaitable[Any]],
                 port: int, timeout: float | None) -> None:
        self._worker = worker
        self._handler = handler
        self._timeout = timeout
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._ucx = worker.listen(port, self._on_connection)
        # UCX keeps the listener (and calls back into it) while an endpoint it accepted
        # exists: each accepted endpoint keeps it alive; after close() this weak
        # reference still reaches it to turn late connection requests away.
        self._ucx_ref = weakref.ref(self._ucx)
        self._port, self._ip = int(self._ucx.port), str(self._ucx.ip)
        worker.wake()

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    @property
    def ip(self) -> str:
        return self._ip

    def _on_connection(self, conn_request: int) -> None:
        # Runs inside ucp_worker_progress: only schedule work here.
        task = asyncio.get_running_loop().create_task(self._accept(conn_request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, conn_request: int) -> None:
        listener = self._ucx_ref()
        if listener is None:  # pragma: no cover - UCX released it meanwhile
            return
        if self._closed:
            # Closed, but endpoints it accepted keep UCX's listener (and its port) alive:
            # turn the request away at once, so the client fails instead of waiting.
            try:
                _ucx.close_endpoint(_ucx.endpoint_from_conn_request(listener,
                                                                    conn_request))
            except Exception:  # pragma: no cover - the client gave up meanwhile
                log.debug("listener: turning a connection away failed", exc_info=True)
            return
        try:
            ucx_ep = _ucx.endpoint_from_conn_request(listener, conn_request)
            ep = await _handshake(self._worker, ucx_ep, self._timeout, keep=listener)
        except Exception:
            log.exception("listener: accepting a connection failed")
            return
        try:
            await self._handler(ep)
        except Exception:
            log.exception("listener: the connection handler raised")

    def abort(self) -> None:
        """Stop accepting new connections at once (idempotent)."""
        self._closed = True
        self._ucx = None

    async def close(self) -> None:
        """Stop accepting new connections (idempotent); connections being accepted
        finish their handshake."""
        self.abort()

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def listen(handler: Callable[[Endpoint], Awaitable[Any]], port: int = 0, *,
                 worker: Worker | None = None, timeout: float | None = 30.0) -> Listener:
    """Accept connections on ``port`` (0: any free port, see ``listener.port``).

    ``handler(ep)`` is a coroutine function, run as a task for each new connection.

    Raises
    ------
    ValueError
        ``port`` is not in [0, 65535], or a bad ``timeout`` (the handshake's deadline).
    UcxCommError
        The port cannot be bound.
    """
    _check_args(port, timeout, 0, "listen")
    return Listener(worker or default_worker(), handler, port, timeout)


async def connect(host: str, port: int, *, worker: Worker | None = None,
                  timeout: float | None = 30.0) -> Endpoint:
    """Connect to a :func:`listen`-ing peer at ``host:port``.

    Raises
    ------
    TypeError, ValueError
        ``host`` is not a non-empty string, ``port`` not in [1, 65535], or a bad
        ``timeout`` (before any I/O).
    CommTimeoutError
        Not established within ``timeout`` seconds.
    PeerFailure
        Nothing accepted the connection (refused: nobody listens there, or a listener
        that was closed), or the host is unreachable.
    UcxCommError
        ``host`` is not a valid address or resolvable name.
    ClosedError
        ``worker`` is closed.
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"connect: host must be a non-empty str, got {host!r}")
    _check_args(port, timeout, 1, "connect")
    worker = worker or default_worker()
    if worker.closed:
        raise ClosedError("the worker is closed")
    ucx_ep = worker.connect_sockaddr(host, port)
    try:
        return await _handshake(worker, ucx_ep, timeout)
    except PeerFailure as exc:
        reason = str(exc.__cause__ or exc)
        raise PeerFailure(f"cannot connect to {host}:{port}: refused or unreachable "
                          f"(nothing listening there?): {reason}") from exc

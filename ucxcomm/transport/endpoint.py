"""``Endpoint``: a UCX endpoint from our worker to one peer worker.

An endpoint carries raw 64-bit tags: the communicator layer's :class:`~.base.Link`
(``isend``, and ``sender`` for compiled callers) and ``send``/``recv`` on an
endpoint from a worker address. The rank-less connections of :mod:`ucxcomm.pipes`
(tags scoped per connection, objects, streams, signals) derive from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import ClosedError, PeerFailure, TruncationError, UcxCommError, copy_of
from . import _ucx
from .base import FULL_MASK, Link, Peers, RecvResult, Remote, Target
from .counters import Counters

__all__ = ["FAST_SEND_TRANSPORTS", "Endpoint"]

#: Transports on which fast-completion sends help (measured on sysv/posix + cma; see
#: Worker.send_raw for the size limit).
FAST_SEND_TRANSPORTS = frozenset({"self", "sysv", "posix", "xpmem", "knem", "cma"})


class _Owner(Protocol):
    """What an endpoint needs from the worker that created it (the Worker)."""

    @property
    def closed(self) -> bool: ...
    def forget(self, ep: Any) -> None: ...
    def send(self, ep_handle: int, obj: Any, tag: int, peers: Peers,
             fast: bool = False) -> asyncio.Future | None: ...
    def ep_send(self, ep_handle: int, peers: Peers, fast: bool) -> Any: ...
    @property
    def counters(self) -> Counters: ...
    def send_raw(self, ep_handle: int, target: Target, tag: int, peers: Peers,
                 fast: bool = False) -> asyncio.Future | None: ...
    def send_ptr(self, obj: Any) -> Target: ...
    def recv_ptr(self, obj: Any) -> Target: ...
    def recv_into(self, target: Target, tag: int, mask: int, peers: Peers,
                  finish: Callable[[RecvResult], Any] | None = None,
                  spin: bool = False, post: bool = False) -> RecvResult | asyncio.Future: ...
    def recv_alloc(self, tag: int, mask: int, peers: Peers,
                   spin: bool = False) -> RecvResult | asyncio.Future: ...
    def tag_recv(self, target: Target, tag: int, mask: int,
                 peers: Peers = None) -> asyncio.Future | None: ...
    async def complete(self, fut: asyncio.Future) -> Any: ...
    def cancel(self, fut: asyncio.Future) -> bool: ...
    def wake(self) -> None: ...
    def fail_peer(self, peer: Any, exc: BaseException | None = None,
                  grace: float | None = None) -> None: ...
    def is_dead(self, peer: Any) -> bool: ...
    def forget_peer(self, peer: Any) -> None: ...
    def remote_memory(self, rkey: bytes, address: int, nbytes: int,
                      peer: Any = None, *, strict: bool = False) -> Remote: ...
    async def drain(self, peers: Peers, timeout: float) -> None: ...
    def recv_posted(self, target: Target, tag: int, mask: int,
                    peers: Peers) -> RecvResult | asyncio.Future: ...


class Endpoint(Link):
    """A UCX endpoint created by :meth:`Worker.connect` (or adopted by the worker).

    ``peer`` is an opaque label (the comm layer uses world ranks) used to fail pending
    operations when that peer is declared dead.
    """

    __slots__ = ("_closed", "_ep", "_fast", "_handle", "_peers", "_reason", "_worker",
                 "isend", "peer", "sender")

    def __init__(self, worker: _Owner, ucx_ep: Any, peer: Any = None) -> None:
        self._worker = worker
        self._ep = ucx_ep
        self._handle = ucx_ep.handle
        self.peer = peer
        self._peers = frozenset((peer,)) if peer is not None else None
        self._closed = False
        # What ended the endpoint from the peer's side (it left: PeerFailure; a
        # connection refused it: ProtocolError), raised by later calls instead of
        # ClosedError.
        self._reason: PeerFailure | None = None
        self._fast = self._fast_lanes()
        # isend (Link.isend) is one compiled call: the engine's sender for this endpoint
        # (Link.sender), whose closed flag this object keeps current.
        self.sender = worker.ep_send(self._handle, self._peers, self._fast)
        self.isend = self.sender.send
        if peer is not None:  # (its sends count for the peer: Worker.traffic)
            worker.counters.link(self._handle, peer, self._fast)

    def _fast_lanes(self) -> bool:
        """Fast-completion sends when every lane is shared memory or self (see worker)."""
        try:
            lanes = _ucx.endpoint_transports(self._handle)
        except Exception:  # pragma: no cover - endpoint not wired up yet
            lanes = []
        return bool(lanes) and all(tl in FAST_SEND_TRANSPORTS for tl, _ in lanes)

    def _label(self) -> str:
        return str(self.peer[1]) if isinstance(self.peer, tuple) else str(self.peer)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise self._ended_error()

    def _ended_error(self) -> UcxCommError:
        """What a call on the released endpoint raises: a fresh copy of what ended the
        connection from the peer's side (a kept, raised exception would hold the frames
        it passed through), or ClosedError when we closed it."""
        r = self._reason
        return copy_of(r) if r is not None else ClosedError("the endpoint is closed")

    def isend_raw(self, target: tuple[Any, int, Any, bool], tag: int) -> Any:
        """Like :meth:`isend` for a target prepared by ``Worker.send_ptr``."""
        if self._closed:
            raise ClosedError("the endpoint is closed")
        return self._worker.send_raw(self._handle, target, tag, self._peers, self._fast)

    def remote_memory(self, rkey: bytes, address: int, nbytes: int) -> Remote:
        """The peer's registered memory (``rkey``, ``address`` and ``nbytes`` from its
        ``worker.register(buf)``): a :class:`~ucxcomm.transport.rma.RemoteMemory` with
        ``put``, ``get``, ``flush`` and atomics (``fetch_add``, ``compare_swap``...);
        its waits fail with ``PeerFailure`` once this endpoint's peer is declared dead.

        Raises
        ------
        ValueError
            ``rkey`` is not a remote key.
        ClosedError
        """
        self._check_open()
        return self._worker.remote_memory(rkey, address, nbytes, self.peer)

    def _wire_tag(self, tag: Any, send: bool) -> int:
        """The UCX tag that ``send``/``recv`` use for ``tag``: here the 64-bit tag itself
        (a :class:`~ucxcomm.pipes.Connection` scopes its user tags instead)."""
        if type(tag) is not int or not 0 <= tag < (1 << 64):
            raise ValueError(f"tag {tag!r} must be an int in [0, 2**64)")
        return tag

    async def send(self, buf: Any, tag: int = 0) -> None:
        """Send the bytes of ``buf`` with ``tag`` (on this endpoint the 64-bit UCX tag;
        on a connection a user tag scoped to it); returns when ``buf`` may be reused.

        Raises
        ------
        TypeError, ValueError
            ``buf`` is not a contiguous buffer, or bad tag (nothing is sent).
        ClosedError, PeerFailure
        """
        if self._closed:
            raise self._ended_error()
        fut = self.isend(buf, self._wire_tag(tag, True))
        if fut is not None:
            await self._worker.complete(fut)

    async def recv(self, buf: Any, tag: int = 0) -> int:
        """Receive the next message with ``tag`` (as for :meth:`send`; here from any
        endpoint of the worker, on a connection from its peer) into ``buf``; returns its
        size in bytes.

        Raises
        ------
        TypeError, ValueError
            ``buf`` is not a contiguous writable buffer, or bad tag.
        TruncationError
            The message was larger than ``buf`` (consumed; ``buf`` holds its prefix).
        ClosedError, PeerFailure
        """
        self._check_open()
        worker = self._worker
        target = worker.recv_ptr(buf)
        res: Any = worker.recv_into(target, self._wire_tag(tag, False), FULL_MASK,
                                    self._peers)
        if type(res) is not tuple:
            res = await worker.complete(res)
        _, nbytes, cap = res
        if nbytes > cap:
            raise TruncationError(f"message of {nbytes} bytes truncated to the {cap}-byte "
                                  "receive buffer", nbytes=nbytes, capacity=cap)
        return int(nbytes)

    def transports(self) -> list[tuple[str, str]]:
        """The (transport, device) lanes UCX chose, e.g. ``[("posix", "memory")]``."""
        self._check_open()
        return _ucx.endpoint_transports(self._handle)

    def transport_info(self) -> list[tuple[str, str]]:
        """The (transport, device) lanes UCX chose for this endpoint's tag traffic, e.g.
        ``[("tcp", "lo")]`` (the same as :meth:`transports`; one-sided traffic has its
        own endpoints: ``remote.transports()``).

        Raises
        ------
        ClosedError
        """
        return self.transports()

    # ------------------------------------------------------------ release
    def abort(self) -> None:
        """Close at once (idempotent); pending operations on it fail."""
        self._end(streams=True)

    def _end(self, streams: bool) -> None:
        """Release the endpoint (idempotent). ``streams``: a close from this side (a
        subclass aborts what it has open); otherwise the peer left."""
        if self._closed:
            return
        self._closed = True
        self.sender.closed = True
        self._releasing(streams)
        dead = self.peer is not None and self._worker.is_dead(self.peer)
        if self.peer is not None and not self._worker.closed:
            self._worker.fail_peer(self.peer, ClosedError("the endpoint was closed"),
                                   grace=0.0)
        _ucx.close_endpoint(self._ep, peer_dead=dead)
        self._worker.forget(self)
        self._ep = None
        self._released()

    def _releasing(self, streams: bool) -> None:
        """A subclass's part of :meth:`_end` before the UCX endpoint is closed."""

    def _released(self) -> None:
        """A subclass's part of :meth:`_end` after the UCX endpoint is closed."""

    async def close(self, timeout: float = 1.0) -> None:
        """Let sends in flight on this endpoint finish (at most ``timeout`` seconds),
        then :meth:`abort`. Idempotent."""
        if self._closed:
            return
        try:
            if self._peers is not None and not self._worker.closed:
                await self._worker.drain(self._peers, timeout)
        finally:
            self.abort()

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


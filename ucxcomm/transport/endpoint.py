"""``Endpoint``: a connection from our worker to one peer worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from .._serialize import decode_header, encode, loads
from ..errors import ClosedError, TruncationError
from . import _ucx
from .base import FULL_MASK, Link, Peers, RecvResult, Remote, Target

__all__ = ["FAST_SEND_TRANSPORTS", "USER_TAG_MAX", "Endpoint"]

#: Largest user tag on a connected endpoint; tags from 2**31 up are ucxcomm's own.
USER_TAG_MAX = (1 << 31) - 1
_OBJ_TAG = 1 << 31  # first message of an object; its frames follow on _OBJ_TAG + 1 + seq
_FRAME_SEQS = (1 << 31) - 1
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
    def send_raw(self, ep_handle: int, target: Target, tag: int, peers: Peers,
                 fast: bool = False) -> asyncio.Future | None: ...
    def send_ptr(self, obj: Any) -> Target: ...
    def recv_ptr(self, obj: Any) -> Target: ...
    def recv_into(self, target: Target, tag: int, mask: int, peers: Peers,
                  finish: Callable[[RecvResult], Any] | None = None,
                  spin: bool = False) -> RecvResult | asyncio.Future: ...
    def recv_alloc(self, tag: int, mask: int, peers: Peers,
                   spin: bool = False) -> RecvResult | asyncio.Future: ...
    def tag_recv(self, target: Target, tag: int, mask: int,
                 peers: Peers = None) -> asyncio.Future | None: ...
    async def complete(self, fut: asyncio.Future) -> Any: ...
    def wake(self) -> None: ...
    def fail_peer(self, peer: Any, exc: BaseException | None = None,
                  grace: float | None = None) -> None: ...
    def remote_memory(self, rkey: bytes, address: int, nbytes: int,
                      peer: Any = None) -> Remote: ...
    async def drain(self, peers: Peers, timeout: float) -> None: ...


class Endpoint(Link):
    """A UCX endpoint created by :meth:`Worker.connect`.

    ``peer`` is an opaque label (the comm layer uses world ranks) used to fail pending
    operations when that peer is declared dead.
    """

    __slots__ = ("_closed", "_ep", "_fast", "_frame_seq", "_handle", "_keep", "_peers",
                 "_recv_ns", "_send_ns", "_worker", "peer")

    def __init__(self, worker: _Owner, ucx_ep: Any, peer: Any = None) -> None:
        self._worker = worker
        self._ep = ucx_ep
        self._handle = ucx_ep.handle
        self.peer = peer
        self._peers = frozenset((peer,)) if peer is not None else None
        self._closed = False
        # Connected (listen/connect) endpoints scope their tags: the upper 32 bits of
        # every UCX tag name the receiving side of this connection (set by the handshake).
        self._send_ns: int | None = None
        self._recv_ns: int | None = None
        self._frame_seq = 0
        # What must outlive the UCX endpoint (the listener that accepted it: UCX keeps
        # calling that listener's callback while the endpoint exists).
        self._keep: Any = None
        # Fast-completion sends when every lane is shared memory or self (see worker).
        try:
            lanes = _ucx.endpoint_transports(self._handle)
        except Exception:  # pragma: no cover - endpoint not wired up yet
            lanes = []
        self._fast = bool(lanes) and all(tl in FAST_SEND_TRANSPORTS for tl, _ in lanes)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the endpoint is closed")

    def isend(self, buf: Any, tag: int) -> Any:
        """Post a tag send; returns a future, or None if it already completed."""
        if self._closed:
            raise ClosedError("the endpoint is closed")
        return self._worker.send(self._handle, buf, tag, self._peers, self._fast)

    def isend_raw(self, target: tuple[Any, int, Any, bool], tag: int) -> Any:
        """Like :meth:`isend` for a target prepared by ``Worker.send_ptr``."""
        if self._closed:
            raise ClosedError("the endpoint is closed")
        return self._worker.send_raw(self._handle, target, tag, self._peers, self._fast)

    def remote_memory(self, rkey: bytes, address: int, nbytes: int) -> Remote:
        """The peer's registered memory (``rkey``, ``address`` and ``nbytes`` from its
        ``worker.register(buf)``): a :class:`~ucxcomm.transport.rma.RemoteMemory` with
        ``put``, ``get``, ``flush`` and atomics (``fetch_add``, ``compare_swap``...);
        its waits fail with ``PeerFailure`` once this endpoint's peer is declared dead."""
        self._check_open()
        return self._worker.remote_memory(rkey, address, nbytes, self.peer)

    def _scoped(self, ns: int | None, tag: int) -> int:
        if ns is None:  # a raw worker-address endpoint: the tag is the UCX tag
            if type(tag) is not int or not 0 <= tag < (1 << 64):
                raise ValueError(f"tag {tag!r} must be an int in [0, 2**64)")
            return tag
        if type(tag) is not int or not 0 <= tag <= USER_TAG_MAX:
            raise ValueError(f"tag {tag!r} must be an int in [0, {USER_TAG_MAX}]")
        return (ns << 32) | tag

    async def send(self, buf: Any, tag: int = 0) -> None:
        """Send the bytes of ``buf``; returns when ``buf`` may be reused.

        On a connected endpoint (:func:`connect`, a :func:`listen` handler) ``tag`` is
        a user tag ``0 <= tag <= 2**31 - 1`` scoped to this connection; on an endpoint
        from a worker address it is the raw 64-bit UCX tag.

        Raises
        ------
        TypeError, ValueError
            ``buf`` is not a contiguous buffer, or bad tag (nothing is sent).
        ClosedError, PeerFailure
        """
        utag = self._scoped(self._send_ns, tag)
        fut = self.isend(buf, utag)
        if fut is not None:
            await self._worker.complete(fut)

    async def recv(self, buf: Any, tag: int = 0) -> int:
        """Receive the next message with ``tag`` (on a connected endpoint: sent on this
        connection) into ``buf``; returns its size in bytes.

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
        res: Any = worker.recv_into(target, self._scoped(self._recv_ns, tag), FULL_MASK,
                                    self._peers)
        if type(res) is not tuple:
            res = await worker.complete(res)
        _, nbytes, cap = res
        if nbytes > cap:
            raise TruncationError(f"message of {nbytes} bytes truncated to the {cap}-byte "
                                  "receive buffer", nbytes=nbytes, capacity=cap)
        return nbytes

    async def send_obj(self, obj: Any) -> None:
        """Send a picklable object on a connected endpoint (numpy payloads zero-copy).

        Raises
        ------
        TypeError
            ``obj`` does not pickle (nothing is sent).
        ClosedError, PeerFailure
        """
        ns = self._check_connected()[0]
        seq = self._frame_seq
        message, frames = encode(obj, seq)
        futs = [self.isend(message, (ns << 32) | _OBJ_TAG)]
        if frames:
            self._frame_seq = (seq + 1) % _FRAME_SEQS
            ftag = (ns << 32) | (_OBJ_TAG + 1 + seq)
            futs.extend(self.isend(f, ftag) for f in frames)
        pending = [f for f in futs if f is not None]
        if len(pending) == 1:
            await self._worker.complete(pending[0])
        elif pending:
            self._worker.wake()
            await asyncio.gather(*pending)

    async def recv_obj(self) -> Any:
        """Receive the next object sent with :meth:`send_obj` on this connection.

        Raises
        ------
        ClosedError, PeerFailure
        """
        base = self._check_connected()[1] << 32
        worker = self._worker
        res: Any = worker.recv_alloc(base | _OBJ_TAG, FULL_MASK, self._peers)
        if type(res) is not tuple:
            res = await worker.complete(res)
        header = decode_header(res[2])
        if not header.sizes:
            return loads(header)
        import numpy as np

        buffers = [np.empty(n, dtype=np.uint8) for n in header.sizes]
        ftag = base | (_OBJ_TAG + 1 + header.seq)
        pending = [f for f in (worker.tag_recv(worker.recv_ptr(b), ftag, FULL_MASK,
                                               self._peers) for b in buffers)
                   if f is not None]
        if pending:
            worker.wake()
            await asyncio.gather(*pending)
        return loads(header, buffers)

    def _check_connected(self) -> tuple[int, int]:
        """``(send namespace, receive namespace)``; raises unless connected."""
        self._check_open()
        if self._send_ns is None or self._recv_ns is None:
            raise TypeError("send_obj/recv_obj need a connected endpoint "
                            "(ucxcomm.transport.connect or a listen handler)")
        return self._send_ns, self._recv_ns

    def transports(self) -> list[tuple[str, str]]:
        """The (transport, device) lanes UCX chose, e.g. ``[("posix", "memory")]``."""
        self._check_open()
        return _ucx.endpoint_transports(self._handle)

    def abort(self) -> None:
        """Close at once (idempotent); pending operations on it fail."""
        if self._closed:
            return
        self._closed = True
        if self.peer is not None and not self._worker.closed:
            self._worker.fail_peer(self.peer, ClosedError("the endpoint was closed"),
                                   grace=0.0)
        _ucx.close_endpoint(self._ep)
        self._worker.forget(self)
        # Release the UCX endpoint, then what it kept alive (in this order: a listener
        # goes, and its port closes, once no endpoint it accepted is left).
        self._ep = None
        self._keep = None

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

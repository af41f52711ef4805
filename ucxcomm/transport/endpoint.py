"""``Endpoint``: a connection from our worker to one peer worker.

Endpoints of a communicator carry raw 64-bit tags. *Connected* endpoints (from
:func:`~ucxcomm.transport.connect` or a :func:`~ucxcomm.transport.listen` handler) scope
their tags to the connection and carry objects, streams, region keys and signals; what
their peer sends is checked before it is used (sizes against what was announced,
headers against limits, remote keys against this UCX's layout: see docs/security.md),
and a violation raises :class:`~ucxcomm.ProtocolError` instead of handing over
anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from .._net import watch_liveness
from .._serialize import CODECS, decode_header, encode, loads
from ..errors import (
    ClosedError,
    PeerFailure,
    ProtocolError,
    TruncationError,
    UcxCommError,
    copy_of,
)
from . import _ucx
from .base import FULL_MASK, Link, Peers, RecvResult, Region, Remote, Target
from .pool import BufferPool
from .stream import DEFAULT_MAX_BATCH_BYTES, DEFAULT_WINDOW, StreamReader, StreamWriter

__all__ = ["FAST_SEND_TRANSPORTS", "MAX_OBJECT_BYTES", "MAX_STREAM", "USER_TAG_MAX",
           "Endpoint", "Signal"]

log = logging.getLogger(__name__)

# Tags of a connected endpoint (the low 32 bits; the high 32 name the receiving side):
#: Largest user tag on a connected endpoint; tags from 2**31 up are ucxcomm's own.
USER_TAG_MAX = (1 << 31) - 1
_OBJ_TAG = 1 << 31  # first message of an object; its frames follow on _OBJ_TAG + 1 + seq
_FRAME_SEQS = (1 << 30) - 1
_CTL_TAG = 3 << 30  # control messages (above every object frame tag):
_SIGNAL_TAG = _CTL_TAG  # put-with-signal notifications
_REGION_TAG = _CTL_TAG + 1  # region keys sent with send_region
_HELLO_TAG = _CTL_TAG + 2  # the connection handshake's check of the data path
_STREAM_TAG = _CTL_TAG + 16  # + 4 * stream id + message kind (stream.py)
#: Largest stream id.
MAX_STREAM = ((1 << 32) - _STREAM_TAG) // 4 - 1
_SIGNAL = struct.Struct("<QQq")  # offset, nbytes, value
_REGION = struct.Struct("<QQ")  # address, nbytes (then the rkey)
_MAX_REGION_MESSAGE = 1 << 16  # a region key message (ours are a few hundred bytes)
#: Most bytes of payload frames one object received on a connection may announce.
MAX_OBJECT_BYTES = 1 << 40
#: After a connection closes, messages its peer sent that nobody received are drained
#: (received and dropped) now and again after these delays (stragglers in flight).
_DRAIN_AGAIN_S = (0.5, 5.0)
#: How long after a connection's end its failure is kept for operations still waiting.
_FORGET_S = 5.0


class Signal(NamedTuple):
    """A put-with-signal notification (:meth:`Endpoint.recv_signal`): the peer wrote
    ``nbytes`` bytes at ``offset`` of the region, then sent ``value``."""

    offset: int
    nbytes: int
    value: int
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
    def send_raw(self, ep_handle: int, target: Target, tag: int, peers: Peers,
                 fast: bool = False) -> asyncio.Future | None: ...
    def send_ptr(self, obj: Any) -> Target: ...
    def exchange(self, ep_handle: int, send: Target, stag: int, speers: Peers, fast: bool,
                 recv: Target, rtag: int, rpeers: Peers) -> Any: ...
    def pair_collectives(self, ep: Any, speers: Peers, rpeers: Peers, rank: int,
                         stag0: int, rtag0: int, **hooks: Any) -> Any: ...
    def group_collectives(self, eps: list[Any], rpeers: Peers, rank: int, stag0: int,
                          rtag0s: Sequence[int], **hooks: Any) -> Any: ...
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
    def drain_namespace(self, ns: int) -> int: ...
    def recv_posted(self, target: Target, tag: int, mask: int,
                    peers: Peers) -> RecvResult | asyncio.Future: ...


def _forget(worker: Any, peer: Any) -> None:
    if not worker.closed:
        worker.forget_peer(peer)


def _drain(worker: Any, ns: int, quiet: int, label: str) -> None:
    """Receive and drop what the peer of a finished connection sent that nobody
    received (UCX keeps unexpected messages until they are received: a client that
    flooded a tag nobody reads held that memory for good). A function, not a method:
    its timers must not keep the endpoint, and what its failure holds, alive. Again after
    ``_DRAIN_AGAIN_S[quiet]`` (messages in flight at close); as long as messages keep
    coming (a peer that goes on sending), every ``_DRAIN_AGAIN_S[0]``."""
    if worker.closed:
        return
    dropped = worker.drain_namespace(ns)
    if dropped:
        log.debug("connection %s: dropped %d unreceived messages", label, dropped)
        quiet = 0
    if quiet < len(_DRAIN_AGAIN_S):
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (closed at interpreter exit: nothing comes any more)
            return
        loop.call_later(_DRAIN_AGAIN_S[quiet], _drain, worker, ns, quiet + 1, label)


class Endpoint(Link):
    """A UCX endpoint created by :meth:`Worker.connect`.

    ``peer`` is an opaque label (the comm layer uses world ranks) used to fail pending
    operations when that peer is declared dead.
    """

    __slots__ = ("_closed", "_ctl", "_ep", "_fast", "_frame_seq", "_handle", "_on_end",
                 "_peers", "_reason", "_recv_ns", "_send_ns", "_sender", "_streams",
                 "_trusted", "_watch", "_worker", "isend", "peer")

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
        self._streams: dict[tuple[str, int], Any] = {}  # open stream readers/writers
        # Connected endpoints: whether the peer proved it holds the listener's token,
        # the connection's TCP stream (its liveness watch) and the task watching it.
        self._trusted = False
        self._ctl: Any = None
        self._watch: asyncio.Task | None = None
        # What ended the connection from the peer's side (it left: PeerFailure; we
        # refused it: ProtocolError), raised by later calls instead of ClosedError.
        self._reason: PeerFailure | None = None
        self._on_end: Callable[[Endpoint], None] | None = None
        self._fast = self._fast_lanes()
        # isend (Link.isend) is one compiled call: the engine's sender for this endpoint,
        # whose handle, lanes and closed flag this object keeps current.
        self._sender = worker.ep_send(self._handle, self._peers, self._fast)
        self.isend = self._sender.send

    def _fast_lanes(self) -> bool:
        """Fast-completion sends when every lane is shared memory or self (see worker)."""
        try:
            lanes = _ucx.endpoint_transports(self._handle)
        except Exception:  # pragma: no cover - endpoint not wired up yet
            lanes = []
        return bool(lanes) and all(tl in FAST_SEND_TRANSPORTS for tl, _ in lanes)

    def _connected(self, recv_ns: int, send_ns: int, trusted: bool,
                   reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   on_end: Callable[[Endpoint], None]) -> None:
        """Make this a connected endpoint (by the handshake of :mod:`.listener`): tags
        scoped by the two namespaces, ``trusted`` when the peer proved it holds the
        token, and the connection's TCP stream watched: when it ends, the peer is
        gone (every pending and later operation fails with PeerFailure).
        ``on_end(self)`` runs once when the endpoint is released."""
        self._recv_ns, self._send_ns, self._trusted = recv_ns, send_ns, trusted
        self._ctl = writer
        self._on_end = on_end
        watch_liveness(writer)
        self._watch = asyncio.get_running_loop().create_task(self._watch_peer(reader))

    async def _watch_peer(self, reader: asyncio.StreamReader) -> None:
        try:
            data = await reader.read(1)
        except asyncio.CancelledError:
            return
        except (ConnectionError, OSError):  # (ETIMEDOUT: the keepalive gave up)
            data = b""
        if self._closed or self._worker.closed or self._reason is not None:
            return
        if data:
            self._refuse("the peer wrote on the connection's control stream after the "
                         "handshake")
            return
        what = "the connection was closed by its peer"
        self._reason = PeerFailure(what)
        log.info("connection %s: %s", self._label(), what)
        # (a separate instance: the one the failed operations raise collects their
        # frames, and the endpoint may be kept by its user)
        self._worker.fail_peer(self.peer, PeerFailure(what))
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        # Released once the grace period in which what it sent is still delivered is
        # over (a handler that never closes its endpoint must not keep it, its
        # descriptor and what the peer sent that nobody received).
        asyncio.get_running_loop().call_later(1.0, self._end, False)

    def _label(self) -> str:
        return str(self.peer[1]) if isinstance(self.peer, tuple) else str(self.peer)

    def _refuse(self, what: str) -> ProtocolError:
        """The peer broke the protocol: the connection ends at once (resources
        released, what the peer sent dropped, again while it keeps sending), and every
        pending and later operation on it fails with the returned
        :class:`ProtocolError`."""
        if self._reason is not None or self._closed:
            return self._reason if isinstance(self._reason, ProtocolError) \
                else ProtocolError(what)
        self._reason = ProtocolError(what)
        log.warning("connection %s: %s; closed", self._label(), what)
        if not self._worker.closed:
            self._worker.fail_peer(self.peer, ProtocolError(what), grace=0.0)
        self.abort()
        return ProtocolError(what)

    def _codec(self, codec: str | None) -> str:
        """``codec`` checked; None: pickle between authenticated peers, else safe."""
        if codec is None:
            return "pickle" if self._trusted else "safe"
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS} or None, got {codec!r}")
        return codec

    @property
    def authenticated(self) -> bool:
        """Whether the peer proved it holds the listener's token (objects then use
        pickle by default; see :meth:`send_obj`)."""
        return self._trusted

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

    def exchange(self, send: tuple[Any, int, Any, bool], stag: int,
                 recv: tuple[Any, int, Any, bool], rtag: int, rpeers: Any) -> Any:
        """See :meth:`Link.exchange` (one crossing into the compiled engine)."""
        if self._closed:
            raise ClosedError("the endpoint is closed")
        return self._worker.exchange(self._handle, send, stag, self._peers, self._fast,
                                     recv, rtag, rpeers)

    def pair_collectives(self, stag0: int, rtag0: int, rank: int, rpeers: Any,
                         **hooks: Any) -> Any:
        """See :meth:`Link.pair_collectives`."""
        self._check_open()
        return self._worker.pair_collectives(self, self._peers, rpeers, rank, stag0, rtag0,
                                             **hooks)

    def group_collectives(self, links: Sequence[Link], stag0: int, rtag0s: Sequence[int],
                          rank: int, rpeers: Any, **hooks: Any) -> Any:
        """See :meth:`Link.group_collectives` (every link an endpoint of this worker)."""
        self._check_open()
        eps = list(links)
        for ep in eps:
            if not isinstance(ep, Endpoint) or ep._worker is not self._worker:
                raise ValueError("group_collectives needs endpoints of one worker")
        return self._worker.group_collectives(eps, rpeers, rank, stag0, rtag0s, **hooks)

    def remote_memory(self, rkey: bytes, address: int, nbytes: int) -> Remote:
        """The peer's registered memory (``rkey``, ``address`` and ``nbytes`` from its
        ``worker.register(buf)``): a :class:`~ucxcomm.transport.rma.RemoteMemory` with
        ``put``, ``get``, ``flush`` and atomics (``fetch_add``, ``compare_swap``...);
        its waits fail with ``PeerFailure`` once this endpoint's peer is declared dead.

        On a connected endpoint the key is checked as coming from the peer (strict: see
        :class:`~ucxcomm.transport.rma.RemoteMemory`).

        Raises
        ------
        ValueError
            ``rkey`` is not a remote key (or, connected, not one the peer could have
            made for memory of its own).
        ClosedError
        """
        self._check_open()
        return self._worker.remote_memory(rkey, address, nbytes, self.peer,
                                          strict=self._recv_ns is not None)

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
        if self._closed:
            raise self._ended_error()
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

    async def send_obj(self, obj: Any, *, codec: str | None = None) -> None:
        """Send an object on a connected endpoint (numpy payloads zero-copy).

        ``codec``: ``"pickle"`` (any picklable object; the peer's ``recv_obj`` runs
        whatever the pickle says, so only between peers that trust each other),
        ``"safe"`` (plain data and numpy arrays, nothing callable: see
        :mod:`ucxcomm._serialize`), or None: pickle on a connection authenticated with a
        token, safe otherwise. The receiver must use the same codec.

        Raises
        ------
        TypeError
            ``obj`` does not pickle, or holds what the safe codec does not carry
            (nothing is sent).
        ValueError
            Unknown ``codec``.
        ClosedError, PeerFailure
        """
        codec = self._codec(codec)
        ns = self._check_connected()[0]
        seq = self._frame_seq
        message, frames = encode(obj, seq, codec)
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

    async def recv_obj(self, *, codec: str | None = None) -> Any:
        """Receive the next object sent with :meth:`send_obj` on this connection.

        ``codec`` as for :meth:`send_obj` (the same on both sides). With ``"safe"``,
        nothing the peer sent is unpickled: an object it pickled is refused.

        Raises
        ------
        ProtocolError
            The peer sent a malformed object, one in another codec, or payload frames
            of other sizes than its header announced (refused before anything is built
            from them; frames are received only as they arrive, never allocated from
            the header's word).
        ValueError
            Unknown ``codec``.
        ClosedError, PeerFailure
        """
        codec = self._codec(codec)
        base = self._check_connected()[1] << 32
        worker = self._worker
        res: Any = worker.recv_alloc(base | _OBJ_TAG, FULL_MASK, self._peers)
        if type(res) is not tuple:
            res = await worker.complete(res)
        try:
            header = decode_header(res[2])
        except ValueError as exc:
            raise self._refuse(f"the peer sent {exc}") from None
        if header.codec != codec:
            raise self._refuse(f"the peer sent a {header.codec}-encoded object; this side "
                               f"accepts codec={codec!r} (pass the same codec= on both "
                               "sides)")
        if header.sizes and header.seq >= _FRAME_SEQS:
            raise self._refuse(f"the peer sent an object header with frame sequence "
                               f"{header.seq} (at most {_FRAME_SEQS - 1})")
        total = sum(header.sizes)
        if total > MAX_OBJECT_BYTES:
            raise self._refuse(f"the peer announced an object of {total} bytes (at most "
                               f"{MAX_OBJECT_BYTES})")
        buffers = []
        ftag = base | (_OBJ_TAG + 1 + header.seq)
        for i, size in enumerate(header.sizes):
            # One frame at a time, allocated at the size that actually arrived.
            got: Any = worker.recv_alloc(ftag, FULL_MASK, self._peers)
            if type(got) is not tuple:
                got = await worker.complete(got)
            if got[1] != size:
                raise self._refuse(f"frame {i} of an object has {got[1]} bytes where its "
                                   f"header announced {size}")
            buffers.append(got[2])
        if codec == "pickle":
            return loads(header, buffers)
        try:
            return loads(header, buffers)
        except ValueError as exc:
            raise self._refuse(f"the peer sent {exc}") from None

    def _check_connected(self) -> tuple[int, int]:
        """``(send namespace, receive namespace)``; raises unless connected."""
        self._check_open()
        if self._send_ns is None or self._recv_ns is None:
            raise TypeError("send_obj/recv_obj, streams and signals need a connected "
                            "endpoint (ucxcomm.transport.connect or a listen handler)")
        return self._send_ns, self._recv_ns

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

    # ------------------------------------------------------------ streams
    def _stream_tag(self, stream: int, kind: int, *, send: bool) -> int:
        ns = self._send_ns if send else self._recv_ns
        return (ns << 32) | (_STREAM_TAG + 4 * stream + kind)  # type: ignore[operator]

    def _new_stream(self, side: str, stream: int) -> None:
        self._check_connected()
        if type(stream) is not int or not 0 <= stream <= MAX_STREAM:
            raise ValueError(f"stream {stream!r} must be an int in [0, {MAX_STREAM}]")
        if (side, stream) in self._streams:
            what = "writer" if side == "w" else "reader"
            raise ValueError(f"stream {stream} already has an open {what} on this "
                             "endpoint; close it first")

    def stream_writer(self, stream: int = 0, *, codec: str | None = None) -> StreamWriter:
        """The sending side of stream ``stream`` on this connection: ``await
        w.send(arrays)`` per batch, ``await w.close()`` to end it (or ``async with``).

        The peer reads it with :meth:`stream_reader` (same ``stream``); sends wait while
        the reader's window is full (backpressure). ``codec`` encodes each batch's
        ``meta`` (as for :meth:`send_obj`; the reader must use the same). See
        docs/pipelines.md.

        Raises
        ------
        ValueError
            Bad ``stream`` or ``codec``, or a writer for it is already open here.
        TypeError
            Not a connected endpoint. ClosedError.
        """
        codec = self._codec(codec)
        self._new_stream("w", stream)
        w = self._streams[("w", stream)] = StreamWriter(self, stream, codec)
        return w

    def stream_reader(self, stream: int = 0, *, window: int = DEFAULT_WINDOW,
                      pool: BufferPool | None = None, gpu: bool = False,
                      codec: str | None = None,
                      max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> StreamReader:
        """The receiving side of stream ``stream``: ``async for batch in reader``, each
        :class:`~ucxcomm.transport.stream.Batch` released when done (``with batch:``).

        Parameters
        ----------
        stream : int
            Which stream of this connection (the writer uses the same id).
        window : int
            Most batches the writer may have sent that the consumer has not released
            (memory on both sides is bounded by it).
        pool : BufferPool, optional
            Where received arrays live; default: a new host pool (``gpu=True``: a GPU
            pool). Several readers may share one.
        gpu : bool
            Receive into GPU memory (a cupy :class:`BufferPool`) when no ``pool`` is
            given.
        codec : str, optional
            How batches' ``meta`` is decoded (as for :meth:`recv_obj`: the writer must
            use the same; with ``"safe"`` nothing the writer sends is unpickled).
        max_batch_bytes : int
            Most bytes one batch may announce (4 GiB by default): the reader allocates
            a batch's buffers when its header arrives, so this, times ``window``, bounds
            what a writer can make it allocate.

        Raises
        ------
        ValueError
            Bad ``stream``, ``window``, ``codec`` or ``max_batch_bytes``, or a reader for
            it is already open here.
        TypeError
            Not a connected endpoint, or ``pool`` is not a BufferPool.
        UnsupportedError
            ``gpu=True`` without cupy. ClosedError.
        """
        codec = self._codec(codec)
        self._new_stream("r", stream)
        if type(window) is not int or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if type(max_batch_bytes) is not int or max_batch_bytes < 0:
            raise ValueError(f"max_batch_bytes must be an int >= 0, got "
                             f"{max_batch_bytes!r}")
        if pool is None:
            pool = BufferPool(gpu=gpu)
        elif not isinstance(pool, BufferPool):
            raise TypeError(f"pool must be a BufferPool, got {type(pool).__name__}")
        r = self._streams[("r", stream)] = StreamReader(self, stream, window, pool, codec,
                                                        max_batch_bytes)
        return r

    # -------------------------------------------------- one-sided + signal
    async def send_region(self, region: Region) -> None:
        """Send ``region``'s key (from ``worker.register``/``allocate``) to the peer,
        which gets a :class:`~ucxcomm.transport.rma.RemoteMemory` for it from
        :meth:`recv_remote_memory`.

        Raises
        ------
        TypeError
            ``region`` is not a registered region, or not a connected endpoint.
        ClosedError, PeerFailure
        """
        send_ns = self._check_connected()[0]
        if not isinstance(region, Region):
            raise TypeError(f"expected a region from worker.register/allocate, got "
                            f"{type(region).__name__}")
        msg = _REGION.pack(region.address, region.nbytes) + bytes(region.rkey)
        fut = self.isend(msg, (send_ns << 32) | _REGION_TAG)
        if fut is not None:
            await self._worker.complete(fut)

    async def recv_remote_memory(self) -> Remote:
        """The peer's memory whose key it sent with :meth:`send_region` (in order):
        ``put``, ``get``, ``flush``, atomics; use it with :meth:`put_signal`.

        Raises
        ------
        ProtocolError
            The peer sent a malformed region message or a key this side does not use:
            one whose layout differs from this UCX's keys, whose owner's address is
            malformed or names this process, or that maps memory directly (only keys of
            registered memory are accepted from a connection).
        ClosedError, PeerFailure
        """
        recv_ns = self._check_connected()[1]
        worker = self._worker
        res: Any = worker.recv_alloc((recv_ns << 32) | _REGION_TAG, FULL_MASK, self._peers)
        if type(res) is not tuple:
            res = await worker.complete(res)
        data = bytes(res[2])
        if not _REGION.size < len(data) <= _MAX_REGION_MESSAGE:
            raise self._refuse(f"the peer sent a region message of {len(data)} bytes")
        address, nbytes = _REGION.unpack_from(data)
        try:
            return self.remote_memory(data[_REGION.size:], address, nbytes)
        except ValueError as exc:
            raise self._refuse(f"the peer sent an unusable region key: {exc}") from None

    async def put_signal(self, remote: Remote, buf: Any, offset: int = 0,
                         value: int = 0) -> None:
        """Write ``buf`` at ``offset`` of the peer's ``remote`` memory, then notify the
        peer (:meth:`recv_signal` returns ``Signal(offset, nbytes, value)``).

        The notification never arrives before the data: the put is flushed (complete at
        the target, ``remote.flush()``) before the notification is sent on this
        endpoint. Returns when ``buf`` may be reused and the notification is sent.

        Raises
        ------
        TypeError, ValueError
            ``buf`` is not a contiguous host buffer, ``value`` not a 64-bit int.
        WindowError
            The write would fall outside the remote region (nothing is written).
        ClosedError, PeerFailure
        """
        send_ns = self._check_connected()[0]
        if isinstance(value, bool) or not isinstance(value, int) \
                or not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"value must be a 64-bit int, got {value!r}")
        nbytes = self._worker.send_ptr(buf)[1]
        await remote.put(buf, offset)
        await remote.flush()
        fut = self.isend(_SIGNAL.pack(int(offset), nbytes, value),
                         (send_ns << 32) | _SIGNAL_TAG)
        if fut is not None:
            await self._worker.complete(fut)

    async def recv_signal(self) -> Signal:
        """The next notification of a :meth:`put_signal` by the peer (in order); the
        data it announces is in the region when this returns.

        Raises
        ------
        ProtocolError
            The peer sent a notification of another size than a signal's (nothing
            truncated or padded is handed over).
        ClosedError, PeerFailure
        """
        recv_ns = self._check_connected()[1]
        worker = self._worker
        buf = bytearray(_SIGNAL.size)
        res: Any = worker.recv_posted(worker.recv_ptr(buf), (recv_ns << 32) | _SIGNAL_TAG,
                                      FULL_MASK, self._peers)
        if type(res) is not tuple:
            res = await worker.complete(res)
        if res[1] != _SIGNAL.size:
            raise self._refuse(f"the peer sent a signal of {res[1]} bytes (a signal has "
                               f"{_SIGNAL.size})")
        return Signal(*_SIGNAL.unpack(buf))

    def abort(self) -> None:
        """Close at once (idempotent); pending operations on it fail."""
        self._end(streams=True)

    def _end(self, streams: bool) -> None:
        """Release the endpoint (idempotent). ``streams``: abort its streams too; when
        the peer left (not ``streams``), readers keep the batches that arrived, to
        deliver before they raise the peer's failure."""
        if self._closed:
            return
        self._closed = True
        self._sender.closed = True
        for stream in list(self._streams.values()) if streams else ():
            stream.abort(self._ended_error() if self._reason is not None else None)
        dead = self.peer is not None and self._worker.is_dead(self.peer)
        if self.peer is not None and not self._worker.closed:
            self._worker.fail_peer(self.peer, ClosedError("the endpoint was closed"),
                                   grace=0.0)
        _ucx.close_endpoint(self._ep, peer_dead=dead)
        self._worker.forget(self)
        self._ep = None
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._recv_ns is not None and not self._worker.closed:
            _drain(self._worker, self._recv_ns, 0, self._label())
        if self._on_end is not None:  # (a connection: its label is never used again)
            on_end, self._on_end = self._on_end, None
            on_end(self)
            # Its failure is forgotten once the operations still waiting on it have
            # failed with it (the progress task polls them within milliseconds).
            with contextlib.suppress(RuntimeError):  # (no loop: nothing waits any more)
                asyncio.get_running_loop().call_later(_FORGET_S, _forget, self._worker,
                                                      self.peer)

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

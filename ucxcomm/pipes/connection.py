"""``Connection``: the endpoint a :func:`~ucxcomm.pipes.connect` or a
:func:`~ucxcomm.pipes.listen` handler gets, for programs without ranks.

A connection is a transport :class:`~ucxcomm.transport.endpoint.Endpoint` whose tags are
scoped to it (the upper 32 bits of every UCX tag name the receiving side, agreed by the
handshake) and that carries objects, streams, region keys and signals besides buffers.
What its peer sends is checked before it is used (sizes against what was announced,
headers against limits, remote keys against this UCX's layout: see docs/security.md),
and a violation raises :class:`~ucxcomm.ProtocolError` instead of handing over
anything. The connection's TCP socket from the handshake stays open as its liveness
watch: when it ends, the peer is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from .._net import watch_liveness
from .._serialize import CODECS, Header, MalformedObject, recv_object, send_object
from ..errors import PeerFailure, ProtocolError, UcxCommError
from ..tags import (
    CONN_FRAME_SEQS,
    CONN_MAX_STREAM,
    CONN_NS_MASK,
    CONN_OBJ,
    CONN_REGION,
    CONN_SIGNAL,
    CONN_STREAM,
    CONN_USER_TAG_MAX,
    conn_tag,
)
from ..transport.base import FULL_MASK, Region, Remote
from ..transport.endpoint import Endpoint
from .pool import BufferPool
from .stream import DEFAULT_MAX_BATCH_BYTES, DEFAULT_WINDOW, StreamReader, StreamWriter

__all__ = ["MAX_OBJECT_BYTES", "Connection", "Signal"]

log = logging.getLogger(__name__)

# The connection's tags: ucxcomm/tags.py (CONN_*: the low 32 bits; conn_tag adds the
# receiving side's namespace above them).
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
    """A put-with-signal notification (:meth:`Connection.recv_signal`): the peer wrote
    ``nbytes`` bytes at ``offset`` of the region, then sent ``value``."""

    offset: int
    nbytes: int
    value: int


def drop_unreceived(worker: Any, keep: Collection[int]) -> int:
    """Receive and drop every message already at ``worker`` whose namespace (a
    connection tag's upper 32 bits) is not in ``keep``: a binary search over namespace
    prefixes with non-destructive probes, descending only into prefixes a message
    matches (about 64 probes per namespace that has messages waiting). For workers that
    carry connections only: a peer can address any namespace, UCX matches across the
    worker, and nobody would ever receive those. Returns how many."""
    if worker.closed:
        return 0
    probe = worker.probe
    dropped = 0
    stack = [(0, 0)]  # (namespace prefix, its length in bits)
    while stack:
        value, bits = stack.pop()
        shift = 64 - bits
        if probe(value << shift if bits else 0,
                 ((1 << bits) - 1) << shift if bits else 0) is None:
            continue
        if bits < 32:
            stack.append((value << 1, bits + 1))
            stack.append((value << 1 | 1, bits + 1))
        elif value not in keep:
            dropped += drain_namespace(worker, value)
    return dropped


def drain_namespace(worker: Any, ns: int) -> int:
    """Receive and drop every message already at ``worker`` in namespace ``ns`` (a
    closed connection's): UCX keeps unexpected messages until someone receives them.
    Each is received into one byte and thereby discarded (UCX consumes a larger message
    without copying it; a large one's sender is released without its data moving).
    Returns how many."""
    if worker.closed:
        return 0
    tag, mask = conn_tag(ns, 0), CONN_NS_MASK
    dropped = 0
    while worker.probe(tag, mask) is not None:
        try:
            fut = worker.tag_recv(worker.recv_ptr(bytearray(1)), tag, mask, None)
        except UcxCommError:  # (truncated at once: dropped)
            fut = None
        if fut is not None:  # (a large message's release, finishing later)
            fut.add_done_callback(_retrieve)
        dropped += 1
    if dropped:
        worker.wake()
    return dropped


def _obj_frame_tag(ns: int, seq: int) -> int:
    """The tag of an object's payload frames of sequence number ``seq`` in ``ns``."""
    return conn_tag(ns, CONN_OBJ + 1 + seq)


def _retrieve(fut: asyncio.Future) -> None:
    """Retrieve an outcome nobody awaits (no 'exception was never retrieved')."""
    if not fut.cancelled():
        fut.exception()


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
    dropped = drain_namespace(worker, ns)
    if dropped:
        log.debug("connection %s: dropped %d unreceived messages", label, dropped)
        quiet = 0
    if quiet < len(_DRAIN_AGAIN_S):
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (closed at interpreter exit: nothing comes any more)
            return
        loop.call_later(_DRAIN_AGAIN_S[quiet], _drain, worker, ns, quiet + 1, label)


class Connection(Endpoint):
    """A connected endpoint (from :func:`~ucxcomm.pipes.connect` or given to a
    :func:`~ucxcomm.pipes.listen` handler): buffers with user tags, objects, streams,
    region keys and signals, scoped to this connection (see the module docstring).
    ``peer`` labels the connection for failure reports."""

    __slots__ = ("_ctl", "_frame_seq", "_on_end", "_recv_ns", "_send_ns", "_streams",
                 "_trusted", "_watch")

    def __init__(self, worker: Any, ucx_ep: Any, peer: Any = None) -> None:
        super().__init__(worker, ucx_ep, peer)
        # The upper 32 bits of every UCX tag name the receiving side of this
        # connection (set by the handshake).
        self._send_ns: int | None = None
        self._recv_ns: int | None = None
        self._frame_seq = 0
        self._streams: dict[tuple[str, int], Any] = {}  # open stream readers/writers
        # Whether the peer proved it holds the listener's token, the connection's TCP
        # stream (its liveness watch) and the task watching it.
        self._trusted = False
        self._ctl: Any = None
        self._watch: asyncio.Task | None = None
        self._on_end: Callable[[Connection], None] | None = None

    def _connected(self, recv_ns: int, send_ns: int, trusted: bool,
                   reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   on_end: Callable[[Connection], None]) -> None:
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

    def remote_memory(self, rkey: bytes, address: int, nbytes: int) -> Remote:
        """The peer's registered memory (``rkey``, ``address`` and ``nbytes`` from its
        ``worker.register(buf)``): a :class:`~ucxcomm.transport.rma.RemoteMemory` with
        ``put``, ``get``, ``flush`` and atomics (``fetch_add``, ``compare_swap``...);
        its waits fail with ``PeerFailure`` once this endpoint's peer is declared dead.

        The key is checked as coming from the peer (strict: see
        :class:`~ucxcomm.transport.rma.RemoteMemory`).

        Raises
        ------
        ValueError
            ``rkey`` is not a remote key (or, connected, not one the peer could have
            made for memory of its own).
        ClosedError
        """
        self._check_open()
        return self._worker.remote_memory(rkey, address, nbytes, self.peer, strict=True)

    def _wire_tag(self, tag: Any, send: bool) -> int:
        """``tag`` (``0 <= tag <= 2**31 - 1``) scoped to this connection: the UCX tag
        that ``send``/``recv`` (:class:`~ucxcomm.transport.endpoint.Endpoint`'s) use."""
        ns = self._check_connected()[0 if send else 1]
        if type(tag) is not int or not 0 <= tag <= CONN_USER_TAG_MAX:
            raise ValueError(f"tag {tag!r} must be an int in [0, {CONN_USER_TAG_MAX}]")
        return conn_tag(ns, tag)

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
        futs = send_object(self.isend, obj, conn_tag(ns, CONN_OBJ),
                           functools.partial(_obj_frame_tag, ns), seq, codec)
        if len(futs) > 1:  # framed: its sequence number is spent
            self._frame_seq = (seq + 1) % CONN_FRAME_SEQS
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
        ns = self._check_connected()[1]
        worker = self._worker
        res: Any = worker.recv_alloc(conn_tag(ns, CONN_OBJ), FULL_MASK, self._peers)
        if type(res) is not tuple:
            res = await worker.complete(res)
        try:
            obj, _ = await recv_object(res[2], functools.partial(self._recv_frames, ns),
                                       codec, MAX_OBJECT_BYTES)
        except MalformedObject as exc:
            raise self._refuse(f"the peer sent {exc}") from None
        return obj

    async def _recv_frames(self, ns: int, header: Header) -> list[Any]:
        """The payload frames of an object whose ``header`` came in namespace ``ns``
        (:func:`~ucxcomm._serialize.recv_object`'s ``recv_frames``): one at a time,
        each allocated at the size that arrived and refused unless it is the size
        announced; the header's sequence number must name an object frame tag."""
        if header.seq >= CONN_FRAME_SEQS:
            raise self._refuse(f"the peer sent an object header with frame sequence "
                               f"{header.seq} (at most {CONN_FRAME_SEQS - 1})")
        worker = self._worker
        ftag = _obj_frame_tag(ns, header.seq)
        buffers = []
        for i, size in enumerate(header.sizes):
            got: Any = worker.recv_alloc(ftag, FULL_MASK, self._peers)
            if type(got) is not tuple:
                got = await worker.complete(got)
            if got[1] != size:
                raise self._refuse(f"frame {i} of an object has {got[1]} bytes where its "
                                   f"header announced {size}")
            buffers.append(got[2])
        return buffers

    def _check_connected(self) -> tuple[int, int]:
        """``(send namespace, receive namespace)``; raises unless connected."""
        self._check_open()
        if self._send_ns is None or self._recv_ns is None:
            raise TypeError("send_obj/recv_obj, streams and signals need a connected "
                            "endpoint (ucxcomm.pipes.connect or a listen handler)")
        return self._send_ns, self._recv_ns

    def _stream_tag(self, stream: int, kind: int, *, send: bool) -> int:
        ns = self._send_ns if send else self._recv_ns
        return conn_tag(ns, CONN_STREAM + 4 * stream + kind)  # type: ignore[arg-type]

    def _new_stream(self, side: str, stream: int) -> None:
        self._check_connected()
        if type(stream) is not int or not 0 <= stream <= CONN_MAX_STREAM:
            raise ValueError(f"stream {stream!r} must be an int in [0, {CONN_MAX_STREAM}]")
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
        :class:`~ucxcomm.pipes.stream.Batch` released when done (``with batch:``).

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
        fut = self.isend(msg, conn_tag(send_ns, CONN_REGION))
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
        res: Any = worker.recv_alloc(conn_tag(recv_ns, CONN_REGION), FULL_MASK, self._peers)
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
                         conn_tag(send_ns, CONN_SIGNAL))
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
        res: Any = worker.recv_posted(worker.recv_ptr(buf), conn_tag(recv_ns, CONN_SIGNAL),
                                      FULL_MASK, self._peers)
        if type(res) is not tuple:
            res = await worker.complete(res)
        if res[1] != _SIGNAL.size:
            raise self._refuse(f"the peer sent a signal of {res[1]} bytes (a signal has "
                               f"{_SIGNAL.size})")
        return Signal(*_SIGNAL.unpack(buf))

    # ------------------------------------------------------------ release
    def _releasing(self, streams: bool) -> None:
        if streams:
            for stream in list(self._streams.values()):
                stream.abort(self._ended_error() if self._reason is not None else None)

    def _released(self) -> None:
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._recv_ns is not None and not self._worker.closed:
            _drain(self._worker, self._recv_ns, 0, self._label())
        if self._on_end is not None:  # (its label is never used again)
            on_end, self._on_end = self._on_end, None
            on_end(self)
            # Its failure is forgotten once the operations still waiting on it have
            # failed with it (the progress task polls them within milliseconds).
            with contextlib.suppress(RuntimeError):  # (no loop: nothing waits any more)
                asyncio.get_running_loop().call_later(_FORGET_S, _forget, self._worker,
                                                      self.peer)

    async def __aenter__(self) -> Connection:
        return self

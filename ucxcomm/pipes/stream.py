"""Streams of array batches over a connected endpoint, with credit-based backpressure:
``StreamWriter`` (producer side), ``StreamReader`` (consumer side) and ``Batch``.

Wire protocol (tags in the connection's control space, see :mod:`.endpoint`; one
stream per ``(connection, direction, stream id)``):

* **credits** (reader -> writer): the reader grants ``window`` credits when it starts,
  then one per batch the consumer releases, sent in groups of ``window // 2`` (sooner
  when the consumer waits with nothing queued). The writer spends one credit per batch
  and waits for more at zero: at most ``window`` batches are ever sent but not yet
  released, so neither side's memory grows with the stream's length, whatever the
  message sizes (UCX buffers small "eager" messages at the receiver, and over TCP at the
  sender too, with no bound of its own).
* **header** then **data** (writer -> reader): a small binary header (per array: dtype,
  shape, memory order and size; then the user's ``meta`` in the stream's codec)
  followed by one message per array. The reader receives headers as they come (from
  completion callbacks, see :class:`StreamReader`), takes a buffer per array from its
  :class:`~ucxcomm.pipes.pool.BufferPool` and posts the data receives straight into
  them, so the next batches move while the consumer works on this one.
  UCX delivers messages of one tag from one sender in order, and the receives are posted
  in header order, so every array lands in its own batch's buffer. An empty header
  ends the stream.

What the writer sends is checked before it is used: a header's arrays against
:data:`MAX_ARRAYS` and the reader's ``max_batch_bytes`` (sizes consistent with dtype and
shape, no object dtypes), every array's arriving size against its header, and the
number of batches against the credits granted. A writer that breaks any of these gets
its connection closed, and the reader a :class:`~ucxcomm.ProtocolError`: nothing short,
stale or uninitialised is handed over, and a writer that ignores its credits cannot make
the reader hold more than its window.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from .._serialize import decode_dtype, dumps_small, encode_dtype, loads_small
from ..errors import ClosedError, PeerFailure, ProtocolError, copy_of
from ..transport.base import FULL_MASK
from .pool import BufferPool

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["DEFAULT_MAX_BATCH_BYTES", "DEFAULT_WINDOW", "MAX_ARRAYS", "Batch",
           "StreamReader", "StreamWriter"]

log = logging.getLogger(__name__)

#: Batches a reader lets its writer have outstanding by default.
DEFAULT_WINDOW = 8
#: Most arrays in one batch.
MAX_ARRAYS = 4096
#: Most bytes one batch may announce, unless the reader says otherwise
#: (``stream_reader(max_batch_bytes=)``).
DEFAULT_MAX_BATCH_BYTES = 1 << 32
_HEADER, _DATA, _CREDIT = 0, 1, 2  # message kinds of a stream
_U32 = struct.Struct("<I")
_END = b""
_ENDED = object()  # queued at the end of the stream
# Header: version, meta codec (0: no meta), number of arrays; per array its dtype
# (encode_dtype), then ndim, order flag, shape (ndim x u64) and size; then the meta.
_HEAD = struct.Struct("<BBI")
_HEADER_VERSION = 1
_META_CODECS = {"pickle": 1, "safe": 2}
_CODEC_NAMES = {1: "pickle", 2: "safe"}
_ARRAY = struct.Struct("<BB")
_U64 = struct.Struct("<Q")


def _pack_header(specs: list[tuple[Any, tuple[int, ...], bool, int]], meta: Any,
                 codec: str) -> bytes:
    """The header of a batch (``TypeError`` when a dtype or ``meta`` cannot travel)."""
    parts = [b""]
    for dtype, shape, fortran, nbytes in specs:
        parts.append(encode_dtype(dtype) + _ARRAY.pack(len(shape), fortran)
                     + struct.pack(f"<{len(shape)}Q", *shape) + _U64.pack(nbytes))
    meta_codec = 0
    if meta is not None:
        try:
            parts.append(dumps_small(meta, codec))
        except TypeError as exc:
            raise TypeError(f"meta cannot be sent with codec {codec!r}: {exc}") from None
        meta_codec = _META_CODECS[codec]
    parts[0] = _HEAD.pack(_HEADER_VERSION, meta_codec, len(specs))
    return b"".join(parts)


def _parse_header(data: Any, codec: str, max_bytes: int
                  ) -> tuple[list[tuple[Any, tuple[int, ...], bool, int]], Any]:
    """``(specs, meta)`` of a peer's header, every field checked.

    Raises
    ------
    ProtocolError
        Malformed, over the limits, or ``meta`` in another codec than ``codec``.
    """
    try:
        data = memoryview(data).cast("B")
        if len(data) < _HEAD.size:
            raise ValueError(f"a header of {len(data)} bytes")
        version, meta_codec, count = _HEAD.unpack_from(data)
        if version != _HEADER_VERSION:
            raise ValueError(f"header version {version}")
        if count > MAX_ARRAYS:
            raise ValueError(f"a batch of {count} arrays (at most {MAX_ARRAYS})")
        pos, total, specs = _HEAD.size, 0, []
        for _ in range(count):
            dtype, pos = decode_dtype(data, pos)
            if pos + _ARRAY.size > len(data):
                raise ValueError("a truncated header")
            ndim, fortran = _ARRAY.unpack_from(data, pos)
            pos += _ARRAY.size
            if ndim > 64 or fortran > 1 or pos + 8 * ndim + 8 > len(data):
                raise ValueError(f"an array of {ndim} dimensions, order flag {fortran}")
            shape = struct.unpack_from(f"<{ndim}Q", data, pos)
            (nbytes,) = _U64.unpack_from(data, pos + 8 * ndim)
            pos += 8 * ndim + 8
            count_ = 1
            for n in shape:
                count_ *= n
            if dtype.itemsize == 0 or count_ * dtype.itemsize != nbytes:
                raise ValueError(f"a {dtype} array of shape {shape} in {nbytes} bytes")
            total += nbytes
            if total > max_bytes:
                raise ValueError(f"a batch of more than {max_bytes} bytes (the reader's "
                                 "max_batch_bytes)")
            specs.append((dtype, shape, bool(fortran), nbytes))
        if meta_codec == 0:
            if pos != len(data):
                raise ValueError("bytes after the arrays")
            return specs, None
        if _CODEC_NAMES.get(meta_codec) != codec:
            raise ValueError(f"meta in codec {_CODEC_NAMES.get(meta_codec, meta_codec)!r}; "
                             f"this reader accepts {codec!r}")
    except ValueError as exc:
        raise ProtocolError(f"the writer sent {exc}") from None
    meta_bytes = data[pos:]
    if codec == "pickle":
        return specs, loads_small(meta_bytes, codec)
    try:
        return specs, loads_small(meta_bytes, codec)
    except ValueError as exc:
        raise ProtocolError(f"the writer sent {exc}") from None


def _describe(obj: Any) -> tuple[Any, tuple[int, ...], bool]:
    """``(dtype, shape, fortran)`` of an array-like (bytes-like objects: flat bytes)."""
    dtype = getattr(obj, "dtype", None)
    shape = getattr(obj, "shape", None)
    flags = getattr(obj, "flags", None)
    if dtype is None or shape is None:
        try:
            view = memoryview(obj)
        except TypeError:  # DLPack and other exotic objects: their bytes
            return np.dtype(np.uint8), (-1,), False
        return np.dtype(view.format or "B"), tuple(view.shape or ()), False
    fortran = bool(flags is not None and len(shape) > 1 and not flags.c_contiguous
                   and flags.f_contiguous)
    return np.dtype(dtype), tuple(int(n) for n in shape), fortran


class StreamWriter:
    """The producer's side of a stream (``ep.stream_writer(stream)``).

    ``await send(arrays)`` waits while the reader holds its whole window, then sends;
    ``await close()`` ends the stream (the reader's ``async for`` finishes). Several
    tasks may send on one writer: each batch is posted whole, in the order its credit
    was granted.
    """

    def __init__(self, ep: Connection, stream: int, codec: str) -> None:
        self._ep = ep
        self.stream = stream
        self.codec = codec
        self._htag, self._dtag = ep._stream_tag(stream, _HEADER, send=True), \
            ep._stream_tag(stream, _DATA, send=True)
        self._ctag = ep._stream_tag(stream, _CREDIT, send=False)
        self._credits = 0
        self._credit_lock = asyncio.Lock()
        self._closed = False
        self._reason: PeerFailure | None = None
        self._last: tuple[Any, bytes] = (None, b"")  # (specs, header) of the last batch
        #: Batches sent so far.
        self.sent = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise copy_of(self._reason) if self._reason else \
                ClosedError("the stream writer is closed")
        self._ep._check_open()

    async def _acquire(self) -> None:
        """Take one credit, receiving more from the reader while there are none."""
        if self._credits and not self._credit_lock.locked():
            self._credits -= 1
            return
        async with self._credit_lock:
            worker, peers = self._ep._worker, self._ep._peers
            while not self._credits:
                buf = bytearray(_U32.size)  # (a late receive must not share it)
                res: Any = worker.recv_into(worker.recv_ptr(buf), self._ctag, FULL_MASK,
                                            peers)
                if type(res) is not tuple:
                    try:  # shielded: cancelling the wait must not orphan the receive
                        await worker.complete(asyncio.shield(res))
                    except asyncio.CancelledError:
                        if not worker.cancel(res):  # matched already: count it when in
                            res.add_done_callback(functools.partial(self._late_credit, buf))
                        raise
                self._credits += _U32.unpack(buf)[0]
            self._credits -= 1

    def _late_credit(self, buf: bytearray, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._credits += _U32.unpack(buf)[0]

    async def send(self, arrays: Any, meta: Any = None) -> None:
        """Send one batch: an array (numpy, cupy, anything with the buffer protocol,
        ``__cuda_array_interface__`` or DLPack) or a list/tuple of them, plus an optional
        small picklable ``meta`` (labels, ids) the consumer gets as ``batch.meta``.

        Returns when the arrays may be reused. Waits first while the reader already has
        its window of batches that the consumer has not released (backpressure).

        Raises
        ------
        TypeError, ValueError
            Not a contiguous buffer, more than ``MAX_ARRAYS`` arrays, an array of Python
            objects, or a ``meta`` the codec cannot encode (nothing is sent).
        ClosedError
            The writer or the endpoint was closed.
        PeerFailure
            The peer died or the connection broke.
        """
        self._check()
        ep = self._ep
        worker = ep._worker
        items = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]
        if len(items) > MAX_ARRAYS:
            raise ValueError(f"a batch holds at most {MAX_ARRAYS} arrays, got {len(items)}")
        targets = [worker.send_ptr(a) for a in items]  # validates before any I/O
        specs = []
        for a, t in zip(items, targets, strict=True):
            dtype, shape, fortran = _describe(a)
            if shape == (-1,) or dtype.itemsize == 0 or dtype.hasobject:
                if dtype.hasobject:
                    raise TypeError("a stream does not carry arrays of Python objects")
                dtype, shape, fortran = np.dtype(np.uint8), (t[1],), False
            specs.append((dtype, shape, fortran, t[1]))
        if meta is None and specs == self._last[0]:
            header = self._last[1]  # (encoding dtypes costs a few us a batch)
        else:
            header = _pack_header(specs, meta, self.codec)
            if meta is None:
                self._last = (specs, header)
        await self._acquire()
        self._check()
        futs = [ep.isend(header, self._htag)]
        futs.extend(ep.isend_raw(t, self._dtag) for t in targets)
        self.sent += 1
        pending = [f for f in futs if f is not None]
        if len(pending) == 1:
            await worker.complete(pending[0])
        elif pending:
            worker.wake()
            await asyncio.gather(*pending)

    async def close(self) -> None:
        """End the stream: the reader's iteration stops after the batches sent so far.
        Idempotent; a no-op once the endpoint is closed."""
        if self._closed:
            return
        self._closed = True
        self._ep._streams.pop(("w", self.stream), None)
        if self._ep.closed:
            return
        fut = self._ep.isend(_END, self._htag)
        if fut is not None:
            await self._ep._worker.complete(fut)

    def abort(self, reason: PeerFailure | None = None) -> None:
        """Stop using the writer at once, without telling the reader (idempotent).
        ``reason``: what later calls raise instead of ClosedError (the connection's
        end)."""
        if not self._closed:
            self._reason = reason
        self._closed = True
        self._ep._streams.pop(("w", self.stream), None)

    async def __aenter__(self) -> StreamWriter:
        return self

    async def __aexit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.abort()


class Batch:
    """One received batch: ``arrays`` (numpy or cupy arrays, views of pool buffers),
    ``meta`` (what the writer passed) and ``seq`` (its position in the stream, from 0).

    ``len(batch)``, ``batch[i]`` and iteration reach the arrays. Release the batch
    (``batch.release()``, or ``with batch:``) when done with its arrays: their buffers
    go back to the pool and the writer gets a credit. Do not use the arrays afterwards
    (copy what you keep). Release on the event loop's thread (it may send a message).
    """

    __slots__ = ("_bufs", "_reader", "arrays", "meta", "seq")

    def __init__(self, reader: StreamReader, seq: int, arrays: list[Any], meta: Any,
                 bufs: list[Any]) -> None:
        self._reader: StreamReader | None = reader
        self.seq = seq
        self.arrays = arrays
        self.meta = meta
        self._bufs = bufs

    @property
    def released(self) -> bool:
        return self._reader is None

    def release(self) -> None:
        """Give the buffers back and let the writer send one more batch (idempotent)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader._release(self._bufs)
            self._bufs = []

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, i: int) -> Any:
        return self.arrays[i]

    def __iter__(self) -> Any:
        return iter(self.arrays)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._reader is None else "held"
        return f"<Batch {self.seq}: {len(self.arrays)} arrays, {state}>"


class _Pending:
    """A batch whose header arrived and whose data receives are posted (``futs``: each
    receive's result, or its future)."""

    __slots__ = ("bufs", "futs", "meta", "specs")

    def __init__(self, specs: list[Any], meta: Any, bufs: list[Any],
                 futs: list[Any]) -> None:
        self.specs, self.meta, self.bufs, self.futs = specs, meta, bufs, futs


class StreamReader:
    """The consumer's side of a stream (``ep.stream_reader(stream, window=...)``): an
    async iterator of :class:`Batch`, ending when the writer closes the stream.

    Parameters
    ----------
    window : int
        Most batches the writer may have sent that the consumer has not released
        (received, in flight, or held by the consumer).
    pool : BufferPool
        Where the arrays' memory comes from (and returns to).

    Notes
    -----
    Receiving is driven by callbacks, not a task of its own: one header receive is
    always posted; when it completes (during the progress of whoever waits, usually the
    consumer in :meth:`__anext__`) the batch's data receives are posted into pool buffers
    and the next header receive is posted. A task per reader cost a task switch and a
    second spinning waiter per batch (64 KiB batches, window 1, two processes: 126 ->
    84-108 us a batch here, on a loaded machine). Header contents are cached: pickling
    the dtypes of each batch cost ~15 us.
    """

    def __init__(self, ep: Connection, stream: int, window: int, pool: BufferPool,
                 codec: str = "safe", max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
                 ) -> None:
        self._ep = ep
        self.codec = codec
        self.max_batch_bytes = max_batch_bytes
        self._worker = ep._worker
        self._peers = ep._peers
        self.stream = stream
        self.window = window
        self.pool = pool
        self._htag = ep._stream_tag(stream, _HEADER, send=False)
        self._dtag = ep._stream_tag(stream, _DATA, send=False)
        self._ctag = ep._stream_tag(stream, _CREDIT, send=True)
        self._queue: deque[Any] = deque()
        self._header: asyncio.Future | None = None  # the posted header receive
        self._arrived: asyncio.Future | None = None  # a consumer waits for the queue
        self._held = 0  # batches handed to the consumer, not released
        self._owed = 0  # credits not yet sent back
        self._threshold = max(1, window // 2)
        self._granted = 0  # credits sent to the writer so far
        self._headers = 0  # batch headers received so far
        self._seq = 0
        self._closed = False
        self._ended = False  # the end of the stream (or an error) is queued
        self._reason: PeerFailure | None = None  # why it was aborted, if not by us
        self._last: tuple[Any, Any] = (b"", None)  # the last header and its contents
        self._grant(window)
        self._post_header()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------ receiving
    def _push(self, item: Any) -> None:
        self._queue.append(item)
        fut = self._arrived
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _post_header(self) -> None:
        """Post the next header receive; headers already here are taken at once (at
        most ``window`` of them: the writer has no more credits)."""
        worker = self._worker
        while not self._ended and not self._closed:
            try:
                res: Any = worker.recv_alloc(self._htag, FULL_MASK, self._peers)
            except Exception as exc:
                self._fail(exc)
                return
            if type(res) is tuple:
                if not self._take_header(res):
                    return
                continue
            self._header = res
            res.add_done_callback(self._header_done)
            worker.wake()
            return

    def _header_done(self, fut: asyncio.Future) -> None:
        """The posted header receive finished (a done callback; or called by a waiter
        that saw it finish first). Idempotent per receive."""
        if fut is not self._header:
            return
        self._header = None
        if self._closed:
            if not fut.cancelled():
                fut.exception()  # retrieved; nobody wants it
            return
        if fut.cancelled():
            self._fail(ClosedError("the stream's receive was cancelled"))
            return
        exc = fut.exception()
        if exc is not None:
            self._fail(exc)
            return
        if self._take_header(fut.result()):
            self._post_header()

    def _take_header(self, res: Any) -> bool:
        """:meth:`_got_header`, or the stream fails with what it raised (a ``meta`` the
        reader cannot decode, a pool out of memory): raised in a done callback, it was
        only logged, and the consumer and the writer then waited forever. A protocol
        violation also closes the connection (the writer cannot be trusted to send
        what it announces any more)."""
        try:
            self._got_header(res)
        except ProtocolError as exc:
            self._fail(self._ep._refuse(f"stream {self.stream}: {exc}"))
            return False
        except Exception as exc:
            self._fail(exc)
            return False
        return True

    def _fail(self, exc: BaseException) -> None:
        self._ended = True
        self._push(exc)

    def _got_header(self, res: Any) -> None:
        data = res[2]
        if len(data) == 0:
            self._ended = True
            self._push(_ENDED)
            return
        self._headers += 1
        if self._headers > self._granted:
            raise ProtocolError(f"the writer sent batch {self._headers} with "
                                f"{self._granted} credits (it ignores the window)")
        data = bytes(data)  # (a large one arrives as a numpy array)
        last = self._last
        if data == last[0]:
            specs, meta = last[1]
        else:
            specs, meta = _parse_header(data, self.codec, self.max_batch_bytes)
            self._last = (data, (specs, meta))
        worker, pool = self._worker, self.pool
        bufs = [pool.take(spec[3]) for spec in specs]
        futs = []
        for buf, spec in zip(bufs, specs, strict=True):
            # Posted to UCX, never probed: a longer message is consumed without being
            # written (and without memory of its size); its size is checked on arrival.
            futs.append(worker.recv_posted(worker.recv_ptr(buf[:spec[3]]), self._dtag,
                                           FULL_MASK, self._peers))
        self._push(_Pending(specs, meta, bufs, futs))

    def _grant(self, n: int) -> None:
        ep = self._ep
        if ep.closed:
            return
        self._granted += n
        fut = ep.isend(_U32.pack(n), self._ctag)
        if fut is not None:
            fut.add_done_callback(_quiet)
            self._worker.wake()

    def _release(self, bufs: list[Any]) -> None:
        for buf in bufs:
            self.pool.give(buf)
        self._held -= 1
        if self._closed or self._ended:
            return
        self._owed += 1
        if self._owed >= self._threshold:
            self._flush_credits()

    def _flush_credits(self) -> None:
        if self._owed:
            n, self._owed = self._owed, 0
            try:
                self._grant(n)
            except Exception:  # the connection broke: the next receive says so
                log.debug("stream %d: returning credits failed", self.stream, exc_info=True)

    # ------------------------------------------------------------ consuming
    def __aiter__(self) -> StreamReader:
        return self

    async def __anext__(self) -> Batch:
        """The next batch, once all its arrays arrived.

        Raises
        ------
        StopAsyncIteration
            The writer closed the stream.
        ClosedError
            This reader or the endpoint was closed.
        PeerFailure
            The peer died or the connection broke (batches that arrived before are
            delivered first).
        RuntimeError
            The consumer holds the whole window (released nothing) and asks for more:
            that could only hang.
        """
        if self._closed:
            raise copy_of(self._reason) if self._reason else \
                ClosedError("the stream reader is closed")
        queue = self._queue
        worker = self._worker
        while not queue:
            if self._ended:
                raise StopAsyncIteration
            if self._held >= self.window:
                raise RuntimeError(
                    f"the consumer holds all {self.window} batches of the stream's window "
                    "and asks for another: release batches (batch.release() or "
                    "`with batch:`) when done with them")
            self._flush_credits()  # a consumer waiting must not sit on credits
            header = self._header
            if header is not None and header.done():
                self._header_done(header)  # (before its callback ran)
                continue
            self._arrived = fut = asyncio.get_running_loop().create_future()
            try:
                await worker.complete(fut)  # progresses UCX here while it waits
            finally:
                self._arrived = None
            if self._closed:
                raise copy_of(self._reason) if self._reason else \
                ClosedError("the stream reader was closed")
        item = queue.popleft()
        if item is _ENDED:
            queue.appendleft(item)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            queue.appendleft(item)  # every later call fails the same way
            raise item
        futs = [f for f in item.futs if type(f) is not tuple]
        if futs and not all(f.done() for f in futs):
            # Shielded: a consumer cancelled here gets this batch on its next call.
            waiter = asyncio.shield(futs[0] if len(futs) == 1 else asyncio.gather(*futs))
            try:
                await worker.complete(waiter)
            except asyncio.CancelledError:
                queue.appendleft(item)
                raise
            except BaseException:
                for f in futs:
                    f.add_done_callback(_quiet)
                raise
        for f in futs:
            if f.cancelled():
                raise ClosedError("the stream's receive was cancelled")
            exc = f.exception()
            if exc is not None:
                for g in futs:
                    g.add_done_callback(_quiet)
                raise exc
        for i, (got, spec) in enumerate(zip(item.futs, item.specs, strict=True)):
            nbytes = (got if type(got) is tuple else got.result())[1]
            if nbytes != spec[3]:
                exc = self._ep._refuse(f"stream {self.stream}: array {i} of batch "
                                       f"{self._seq} has {nbytes} bytes where its header "
                                       f"announced {spec[3]}")
                self._fail(exc)
                queue.clear()
                queue.append(exc)
                raise exc
        arrays = []
        for buf, (dtype, shape, fortran, nbytes) in zip(item.bufs, item.specs, strict=True):
            arrays.append(buf[:nbytes].view(dtype).reshape(shape,
                                                           order="F" if fortran else "C"))
        self._held += 1
        batch = Batch(self, self._seq, arrays, item.meta, item.bufs)
        self._seq += 1
        return batch

    # --------------------------------------------------------------- close
    def abort(self, reason: PeerFailure | None = None) -> None:
        """Stop at once (idempotent): receives are withdrawn, batches not yet handed out
        are dropped (their buffers are not reused), the writer is not told. ``reason``:
        what later calls raise instead of ClosedError (the connection's end)."""
        if self._closed:
            return
        self._closed = True
        self._reason = reason
        self._ep._streams.pop(("r", self.stream), None)
        worker = self._worker
        header = self._header
        if header is not None and not worker.closed:
            worker.cancel(header)
        for item in self._queue:
            if isinstance(item, _Pending):
                for f in item.futs:
                    if type(f) is tuple:
                        continue
                    f.add_done_callback(_quiet)
                    if not worker.closed:
                        worker.cancel(f)
        self._queue.clear()
        fut = self._arrived
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def close(self) -> None:
        """Stop reading (like :meth:`abort`; idempotent)."""
        self.abort()

    async def __aenter__(self) -> StreamReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _quiet(fut: asyncio.Future) -> None:
    """Retrieve an outcome nobody awaits (no 'exception was never retrieved')."""
    if not fut.cancelled():
        fut.exception()

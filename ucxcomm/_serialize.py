"""The object codec: the object wire format (two codecs, pickle and a safe one) and the
one framing pair that every sender and receiver of objects calls.

A message is ``kind + body``. Kinds ``0`` (pickle) and ``2`` (safe) carry the whole
object inline; kinds ``1`` (pickle) and ``3`` (safe) are *framed*: ``kind, nframes
(u32), seq (u32), nframes x size (u64), body``, followed on the wire by the ``nframes``
payload frames (arrays' memory, sent and received without copies). ``seq`` lets the
receiver post exact receives for the frames of *this* message.

:func:`send_object` and :func:`recv_object` are that framing, written once in the style
of mpi4py's ``pkl5``: they take the caller's send function and frame-receiving function,
and the caller's tags (communicators and connections lay out their tags differently:
:mod:`ucxcomm.tags`). A field of the header is added here only: ``_HDR``, :class:`Header`,
:func:`decode_header` (which bounds every field before use) and the framed branch of
:func:`encode`.

* **pickle** (protocol 5, out-of-band buffers): any picklable object. Unpickling runs
  code the sender chooses: only for peers you trust (ranks of a job, authenticated
  connections).
* **safe**: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``,
  ``bytearray``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, numpy arrays
  (not of object dtype), dtypes and scalars, nested (dict keys and set members: ``str``,
  ``bytes``, ``None``, ``bool``, 64-bit ``int``); nothing else, nothing callable.
  Decoding builds only those types and checks every length against the message before
  using it: what it allocates is bounded by a small multiple of the message's size
  (a Python object, tens of bytes, per item of at least one byte on the wire) plus the
  arrays' own frames, whose sizes the receiver checks against what arrives.
"""

from __future__ import annotations

import pickle
import re
import struct
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["CODECS", "FRAMED", "MAX_FRAMES", "MAX_FRAME_BYTES", "Header", "MalformedObject",
           "decode_dtype", "decode_header", "dumps_small", "encode", "encode_dtype", "loads",
           "loads_inline", "loads_small", "recv_object", "send_encoded", "send_object"]

#: The codec names (``codec=`` of ``send_obj``/``recv_obj`` and stream ``meta``).
CODECS = ("pickle", "safe")
_INLINE, _FRAMED, _SAFE_INLINE, _SAFE_FRAMED = 0, 1, 2, 3
_CODEC_OF = {_INLINE: "pickle", _FRAMED: "pickle", _SAFE_INLINE: "safe",
             _SAFE_FRAMED: "safe"}
_INLINE_PREFIX = bytes([_INLINE])
_SAFE_PREFIX = bytes([_SAFE_INLINE])
_HDR = struct.Struct("<BII")  # kind, number of frames, frame sequence number
_NO_FRAMES: list[memoryview] = []  # shared, never mutated
_dumps = pickle.dumps
_loads = pickle.loads

#: Limits for a framed header from a peer (a corrupted or hostile message must not make
#: the receiver allocate absurd amounts): frames per message, bytes per frame. An object
#: with more out-of-band buffers than MAX_FRAMES is sent with its buffers in-band.
MAX_FRAMES = 4096
MAX_FRAME_BYTES = 1 << 40

#: What a send function returns (a future, or None when the send finished at once).
_Sent = TypeVar("_Sent")


class MalformedObject(ValueError):
    """An object message this side refuses: a malformed or out-of-limits header, another
    codec than the one accepted, or a malformed safe-codec body. Raised before anything
    is built from the message, and before anything is allocated for its frames (a
    connection turns it into :class:`~ucxcomm.ProtocolError`; a ``ValueError`` that
    unpickling raises is the object's own and is not one)."""


def encode(obj: Any, seq: int, codec: str = "pickle") -> tuple[bytes, list[Any]]:
    """``(message, frames)`` for ``obj``; ``frames`` is empty for inline messages.

    Raises
    ------
    TypeError
        ``obj`` does not pickle, or (``codec="safe"``) holds a type the safe codec
        does not carry (raised before anything is sent).
    ValueError
        Unknown ``codec``.
    """
    if codec == "safe":
        return _encode_safe(obj, seq)
    if codec != "pickle":
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    frames: list[pickle.PickleBuffer] = []
    try:
        data = _dumps(obj, protocol=5, buffer_callback=frames.append)
    except Exception as exc:
        raise TypeError(f"cannot send a {type(obj).__name__}: it does not pickle ({exc})"
                        ) from exc
    if not frames:  # the common small-object case, kept short
        return _INLINE_PREFIX + data, _NO_FRAMES
    raws: list[memoryview] = []
    if len(frames) <= MAX_FRAMES:
        try:
            raws = [f.raw() for f in frames]
        except BufferError:  # a non-contiguous out-of-band buffer: fall back to in-band
            raws = []
    if not raws:
        data = pickle.dumps(obj, protocol=5)
        return _INLINE_PREFIX + data, []
    return _framed(_FRAMED, seq, raws) + data, raws


def _framed(kind: int, seq: int, raws: list[Any]) -> bytes:
    return _HDR.pack(kind, len(raws), seq) + struct.pack(f"<{len(raws)}Q",
                                                         *(r.nbytes for r in raws))


class Header:
    """A decoded first message: inline, or the frames to expect."""

    __slots__ = ("codec", "payload", "seq", "sizes")

    def __init__(self, payload: memoryview, seq: int, sizes: tuple[int, ...],
                 codec: str = "pickle") -> None:
        self.payload, self.seq, self.sizes, self.codec = payload, seq, sizes, codec


def loads_inline(data: Any) -> Any:
    """The object of an inline pickle message, or :data:`FRAMED` for any other kind
    (decode those with :func:`decode_header` and :func:`loads`)."""
    if data[0] == _INLINE:
        return _loads(memoryview(data)[1:])
    return _FRAMED_MARK


_FRAMED_MARK = object()
#: What :func:`loads_inline` returns for a message it does not decode itself.
FRAMED = _FRAMED_MARK


def decode_header(data: Any) -> Header:
    """Parse a first message (``bytes``/``bytearray``/``uint8`` array); its ``codec``
    says how the body is encoded (check it before :func:`loads`).

    Raises
    ------
    MalformedObject
        Not an object message of this format (empty, unknown kind, truncated header,
        more than :data:`MAX_FRAMES` frames or a frame over :data:`MAX_FRAME_BYTES`):
        nothing is allocated for it.
    """
    n = len(data)
    if n == 0:
        raise MalformedObject("malformed object message: empty")
    kind = data[0]
    if kind in (_INLINE, _SAFE_INLINE):
        return Header(memoryview(data)[1:], 0, (), _CODEC_OF[kind])
    if kind not in (_FRAMED, _SAFE_FRAMED) or n < _HDR.size:
        raise MalformedObject(f"malformed object message: kind {kind}, {n} bytes")
    _, nframes, seq = _HDR.unpack_from(data, 0)
    if nframes > MAX_FRAMES or n < _HDR.size + 8 * nframes:
        raise MalformedObject(f"malformed object message: {nframes} frames in {n} bytes")
    sizes = struct.unpack_from(f"<{nframes}Q", data, _HDR.size)
    if any(size > MAX_FRAME_BYTES for size in sizes):
        raise MalformedObject(f"malformed object message: a frame of {max(sizes)} bytes")
    return Header(memoryview(data)[_HDR.size + 8 * nframes:], seq, sizes, _CODEC_OF[kind])


def loads(header: Header, buffers: list[Any] | None = None) -> Any:
    """The object, built on ``buffers`` (the received frames) without copying them.

    Raises
    ------
    MalformedObject
        A safe-codec body that is malformed (the codec's own checks).
    """
    if header.codec == "safe":
        try:
            return _SafeDecoder(header.payload, buffers or []).decode()
        except MalformedObject:
            raise
        except ValueError as exc:  # (numpy's, should one slip past the decoder's checks)
            raise MalformedObject(f"malformed safe-codec message: {exc}") from None
    if not header.sizes:
        return pickle.loads(header.payload)
    return pickle.loads(header.payload, buffers=buffers)


# ------------------------------------------------------------- the framing pair
def send_object(send: Callable[[Any, int], _Sent], obj: Any, tag: int,
                frame_tag: Callable[[int], int], seq: int,
                codec: str = "pickle") -> list[_Sent]:
    """Encode ``obj`` and post its messages through ``send(buffer, tag)``: the first
    message with ``tag``, then each payload frame with ``frame_tag(seq)``.

    ``send`` is the caller's (a link's ``isend``), and so are the tags. Returns what the
    ``send`` calls returned, in order; the object went framed, and ``seq`` is spent (the
    caller moves its counter on), exactly when there is more than one (a framed message
    has a frame at least). Inline objects take one call of ``send`` and nothing else
    (the latency-critical path: no further Python frame).

    Raises
    ------
    TypeError, ValueError
        As :func:`encode` (before anything is sent); what ``send`` raises.
    """
    message, frames = encode(obj, seq, codec)
    if not frames:
        return [send(message, tag)]
    return send_encoded(send, message, frames, tag, frame_tag(seq))


def send_encoded(send: Callable[[Any, int], _Sent], message: bytes, frames: list[Any],
                 tag: int, ftag: int) -> list[_Sent]:
    """Post what :func:`encode` made: ``message`` with ``tag``, then each of ``frames``
    with ``ftag`` (the frame tag of the ``seq`` given to :func:`encode`), for a caller
    that encoded the object itself (to send an inline one its own short way)."""
    sent = [send(message, tag)]
    sent.extend(send(frame, ftag) for frame in frames)
    return sent


async def recv_object(data: Any, recv_frames: Callable[[Header], Awaitable[list[Any]]],
                      codec: str | None = None, max_bytes: int | None = None
                      ) -> tuple[Any, int]:
    """``(object, bytes of its payload frames)`` of an object message whose first
    message ``data`` was received; a framed one's frames come from
    ``await recv_frames(header)``, the caller's (its tags, its memory), which must
    return one buffer per size in ``header.sizes``, holding that many bytes.

    Every field is checked before it is used: ``header.sizes`` is bounded by
    :data:`MAX_FRAMES` and :data:`MAX_FRAME_BYTES` and, with ``max_bytes``, their sum
    too; with ``codec``, only that codec is accepted (None: either). A receiver that does not
    trust its peer also allocates frames only as they arrive and checks each against
    its announced size, in ``recv_frames`` (as connections do), and checks
    ``header.seq`` against its tag space there.

    Raises
    ------
    MalformedObject
        A malformed or out-of-limits header, another codec, a malformed safe-codec
        body: before ``recv_frames`` is called, or (the body) before anything is built.
    Exception
        What ``recv_frames`` raises; for the pickle codec, what unpickling raises.
    """
    header = decode_header(data)
    if codec is not None and header.codec != codec:
        raise MalformedObject(f"a {header.codec}-encoded object; this side accepts "
                              f"codec={codec!r} (pass the same codec= on both sides)")
    sizes = header.sizes
    if not sizes:
        return loads(header), 0
    total = sum(sizes)
    if max_bytes is not None and total > max_bytes:
        raise MalformedObject(f"an object header announcing {total} bytes of frames "
                              f"(at most {max_bytes})")
    return loads(header, await recv_frames(header)), total


# ---------------------------------------------------------------- the safe codec
#: Arrays of at least this many bytes travel as frames of their own (zero-copy).
SAFE_FRAME_MIN = 2048
#: Deepest nesting the safe codec encodes or decodes.
SAFE_MAX_DEPTH = 100
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
# A plain dtype string: byte order, type character, optional size and datetime unit.
_DTYPE_STR = re.compile(r"[<>|=]?[?a-zA-Z][0-9]{0,9}(\[[0-9]{0,9}[a-zA-Z]{1,3}\])?")
_CONTAINER_CODES: dict[type, bytes] = {list: b"l", tuple: b"t", set: b"S",
                                       frozenset: b"Z"}
_SAFE_TYPES = ("None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, "
               "set, frozenset, numpy arrays (not of object dtype), dtypes and scalars")


def _check_key(key: Any, error: Any, what: str) -> Any:
    """``key`` if it may be a dict key or set member in the safe codec: ``str``,
    ``bytes``, ``None``, ``bool`` or a 64-bit ``int``. Their hashes cannot be made to
    collide in bulk (strings and bytes are hashed with a per-process secret); floats,
    complex numbers, big integers and tuples can: a 500 KiB set of colliding numbers
    took a decoder 8 s (quadratic in their count)."""
    t = type(key)
    if t is str or t is bytes or key is None or t is bool \
            or (t is int and -(1 << 63) <= key < (1 << 63)):
        return key
    raise error(f"{what} of type {t.__name__} (the safe codec's keys are str, bytes, "
                "None, bool and 64-bit int)")


def _np() -> Any:
    import numpy

    return numpy


def _encode_safe(obj: Any, seq: int) -> tuple[bytes, list[Any]]:
    out = bytearray(_SAFE_PREFIX)
    frames: list[Any] = []
    _SafeEncoder(out, frames).put(obj, 0)
    if not frames:
        return bytes(out), _NO_FRAMES
    body = memoryview(out)[1:]
    return _framed(_SAFE_FRAMED, seq, frames) + body, frames


def dumps_small(obj: Any, codec: str) -> bytes:
    """``obj`` in ``codec`` as one self-contained message body (arrays inline; for
    small things such as a stream batch's ``meta``).

    Raises
    ------
    TypeError
        As :func:`encode`.
    """
    if codec == "pickle":
        try:
            return pickle.dumps(obj, protocol=5)
        except Exception as exc:
            raise TypeError(f"it does not pickle ({exc})") from exc
    out = bytearray()
    _SafeEncoder(out, None).put(obj, 0)
    return bytes(out)


def loads_small(data: Any, codec: str) -> Any:
    """The object of :func:`dumps_small`.

    Raises
    ------
    ValueError
        A malformed safe-codec body.
    """
    if codec == "pickle":
        return pickle.loads(data)
    return _SafeDecoder(data, []).decode()


def encode_dtype(dtype: Any) -> bytes:
    """A numpy dtype in the safe codec's form (TypeError for one holding objects)."""
    out = bytearray()
    _SafeEncoder(out, None).put_dtype(dtype)
    return bytes(out)


def decode_dtype(data: Any, pos: int) -> tuple[Any, int]:
    """``(dtype, position after it)`` of :func:`encode_dtype` output at ``pos``.

    Raises
    ------
    ValueError
        Malformed, or a dtype holding Python objects.
    """
    dec = _SafeDecoder(data, [])
    dec.pos = pos
    return dec.get_dtype(0), dec.pos


class _SafeEncoder:
    __slots__ = ("frames", "out")

    def __init__(self, out: bytearray, frames: list[Any] | None) -> None:
        self.out, self.frames = out, frames  # frames None: arrays inline

    def put(self, obj: Any, depth: int) -> None:
        if depth > SAFE_MAX_DEPTH:
            raise TypeError(f"the safe codec nests at most {SAFE_MAX_DEPTH} levels")
        out = self.out
        t = type(obj)
        if obj is None:
            out += b"N"
        elif t is bool:
            out += b"T" if obj else b"F"
        elif t is int:
            if -(1 << 63) <= obj < (1 << 63):
                out += b"i" + _I64.pack(obj)
            else:
                raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                out += b"I" + _U32.pack(len(raw)) + raw
        elif t is float:
            out += b"f" + _F64.pack(obj)
        elif t is complex:
            out += b"c" + _C128.pack(obj.real, obj.imag)
        elif t is str:
            raw = obj.encode("utf-8", "surrogatepass")
            out += b"s" + _U32.pack(len(raw)) + raw
        elif t is bytes or t is bytearray:
            out += (b"b" if t is bytes else b"B") + _U32.pack(len(obj)) + obj
        elif t is list or t is tuple or t is set or t is frozenset:
            out += _CONTAINER_CODES[t]
            out += _U32.pack(len(obj))
            for item in obj:
                if t is set or t is frozenset:
                    _check_key(item, TypeError, "a set member")
                self.put(item, depth + 1)
        elif t is dict:
            out += b"d" + _U32.pack(len(obj))
            for key, value in obj.items():
                _check_key(key, TypeError, "a dict key")
                self.put(key, depth + 1)
                self.put(value, depth + 1)
        else:
            self.put_numpy(obj, depth)

    def put_numpy(self, obj: Any, depth: int) -> None:
        np = _np()
        out = self.out
        if type(obj) is np.ndarray:
            if obj.dtype.hasobject:
                raise TypeError("the safe codec does not carry arrays of Python objects")
            fortran = obj.ndim > 1 and not obj.flags.c_contiguous and obj.flags.f_contiguous
            if not (obj.flags.c_contiguous or fortran):
                obj = np.ascontiguousarray(obj)
            out += b"a"
            self.put_dtype(obj.dtype)
            out += bytes([obj.ndim, fortran]) + struct.pack(f"<{obj.ndim}Q", *obj.shape)
            raw = obj.reshape(-1, order="F" if fortran else "C").view(np.uint8)
            if self.frames is not None and raw.nbytes >= SAFE_FRAME_MIN \
                    and len(self.frames) < MAX_FRAMES:
                out += b"\x01" + _U32.pack(len(self.frames))
                self.frames.append(memoryview(raw))
            else:
                out += b"\x00" + _U64.pack(raw.nbytes) + raw.tobytes()
        elif isinstance(obj, np.dtype):
            out += b"y"
            self.put_dtype(obj)
        elif isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            out += b"g"
            self.put_dtype(obj.dtype)
            raw = obj.tobytes()
            out += _U32.pack(len(raw)) + raw
        else:
            raise TypeError(f"the safe codec does not carry a {type(obj).__name__} (it "
                            f"carries {_SAFE_TYPES}); between authenticated peers "
                            "codec='pickle' carries anything")

    def put_dtype(self, dtype: Any) -> None:
        if dtype.hasobject:
            raise TypeError("the safe codec does not carry dtypes holding Python objects")
        if dtype.fields is None and dtype.subdtype is None:
            raw = dtype.str.encode("ascii")
            self.out += b"\x00" + bytes([len(raw)]) + raw
        else:  # structured or sub-array: its description, as plain data
            self.out += b"\x01"
            self.put(dtype.descr, 1)


class _SafeDecoder:
    __slots__ = ("buffers", "data", "pos", "used")

    def __init__(self, data: Any, buffers: list[Any]) -> None:
        self.data = memoryview(data).cast("B")
        self.buffers = buffers
        self.pos = 0
        self.used: set[int] = set()

    def fail(self, what: str) -> MalformedObject:
        return MalformedObject(f"malformed safe-codec message: {what} (at byte "
                               f"{self.pos})")

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise self.fail(f"{n} bytes announced, {len(self.data) - self.pos} left")
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def unpack(self, st: struct.Struct) -> Any:
        return st.unpack(self.take(st.size))

    def decode(self) -> Any:
        obj = self.get(0)
        if self.pos != len(self.data):
            raise self.fail("bytes after the object")
        if len(self.used) != len(self.buffers):
            raise self.fail(f"{len(self.buffers)} frames, {len(self.used)} used")
        return obj

    def count(self) -> int:
        (n,) = self.unpack(_U32)
        if n > len(self.data) - self.pos:  # every item takes a byte at least
            raise self.fail(f"{n} items announced")
        return n

    def get(self, depth: int) -> Any:
        if depth > SAFE_MAX_DEPTH:
            raise self.fail(f"nested deeper than {SAFE_MAX_DEPTH}")
        code = bytes(self.take(1))
        if code == b"N":
            return None
        if code == b"T":
            return True
        if code == b"F":
            return False
        if code == b"i":
            return self.unpack(_I64)[0]
        if code == b"I":
            return int.from_bytes(self.take(self.unpack(_U32)[0]), "little", signed=True)
        if code == b"f":
            return self.unpack(_F64)[0]
        if code == b"c":
            re_, im = self.unpack(_C128)
            return complex(re_, im)
        if code == b"s":
            try:
                return str(self.take(self.unpack(_U32)[0]), "utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise self.fail("a string that is not UTF-8") from None
        if code in (b"b", b"B"):
            raw = self.take(self.unpack(_U32)[0])
            return bytes(raw) if code == b"b" else bytearray(raw)
        if code in (b"l", b"t", b"S", b"Z"):
            items = [self.get(depth + 1) for _ in range(self.count())]
            if code == b"l":
                return items
            if code == b"t":
                return tuple(items)
            for item in items:
                _check_key(item, self.fail, "a set member")
            return set(items) if code == b"S" else frozenset(items)
        if code == b"d":
            out = {}
            for _ in range(self.count()):
                key = _check_key(self.get(depth + 1), self.fail, "a dict key")
                out[key] = self.get(depth + 1)
            return out
        if code == b"a":
            return self.get_array(depth)
        if code == b"y":
            return self.get_dtype(depth)
        if code == b"g":
            dtype = self.get_dtype(depth)
            raw = self.take(self.unpack(_U32)[0])
            if dtype.itemsize == 0 or len(raw) != dtype.itemsize:
                raise self.fail(f"a {dtype} scalar of {len(raw)} bytes")
            return _np().frombuffer(raw, dtype=dtype)[0]
        raise self.fail(f"unknown type code {code!r}")

    def get_dtype(self, depth: int) -> Any:
        np = _np()
        form = bytes(self.take(1))
        if form == b"\x00":
            text = bytes(self.take(self.take(1)[0])).decode("ascii", "replace")
            if not _DTYPE_STR.fullmatch(text):
                raise self.fail(f"dtype {text!r}")
            spec: Any = text
        elif form == b"\x01":
            spec = self.get(depth + 1)
            if type(spec) is not list:
                raise self.fail("a structured dtype that is not a list of fields")
        else:
            raise self.fail(f"dtype form {form!r}")
        try:
            dtype = np.dtype(spec)
        except Exception as exc:  # numpy's own checks of the description
            raise self.fail(f"dtype {spec!r}: {exc}") from None
        if dtype.hasobject:
            raise self.fail("a dtype holding Python objects")
        return dtype

    def get_array(self, depth: int) -> Any:
        np = _np()
        dtype = self.get_dtype(depth)
        ndim, fortran = self.take(2)
        if ndim > 64 or fortran > 1:
            raise self.fail(f"array of {ndim} dimensions, order flag {fortran}")
        shape = struct.unpack(f"<{ndim}Q", self.take(8 * ndim))
        count = 1
        for n in shape:
            count *= n
        nbytes = count * dtype.itemsize
        where = self.take(1)[0]
        if where == 0:
            (size,) = self.unpack(_U64)
            raw: Any = self.take(size)
        elif where == 1:
            (index,) = self.unpack(_U32)
            if index >= len(self.buffers) or index in self.used:
                raise self.fail(f"frame {index} of {len(self.buffers)}")
            self.used.add(index)
            raw = memoryview(self.buffers[index]).cast("B")
        else:
            raise self.fail(f"array location {where}")
        if dtype.itemsize == 0 or len(raw) != nbytes:
            raise self.fail(f"a {dtype} array of shape {shape} in {len(raw)} bytes")
        flat = np.frombuffer(raw, dtype=dtype)
        if where == 0:  # (its own memory, writable, not a view of the message)
            flat = flat.copy()
        return flat.reshape(shape, order="F" if fortran else "C")

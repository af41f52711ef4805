"""The object wire format: pickle protocol 5 with out-of-band payload frames.

A message is either ``0x00 + pickle`` (no out-of-band buffers), or
``0x01, nframes (u32), seq (u32), nframes x size (u64), pickle``, followed on the wire by
the ``nframes`` payload frames (numpy arrays' memory, sent and received without copies).
``seq`` lets the receiver post exact receives for the frames of *this* message.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

__all__ = ["FRAMED", "Header", "decode_header", "encode", "loads", "loads_inline"]

_INLINE = 0
_INLINE_PREFIX = bytes([_INLINE])
_FRAMED = 1
_HDR = struct.Struct("<BII")  # kind, number of frames, frame sequence number
_NO_FRAMES: list[memoryview] = []  # shared, never mutated
_dumps = pickle.dumps
_loads = pickle.loads


def encode(obj: Any, seq: int) -> tuple[bytes, list[memoryview]]:
    """``(message, frames)`` for ``obj``; ``frames`` is empty for inline messages.

    Raises
    ------
    TypeError
        ``obj`` does not pickle (raised before anything is sent).
    """
    frames: list[pickle.PickleBuffer] = []
    try:
        data = _dumps(obj, protocol=5, buffer_callback=frames.append)
    except Exception as exc:
        raise TypeError(f"cannot send a {type(obj).__name__}: it does not pickle ({exc})"
                        ) from exc
    if not frames:  # the common small-object case, kept short
        return _INLINE_PREFIX + data, _NO_FRAMES
    raws: list[memoryview] = []
    try:
        raws = [f.raw() for f in frames]
    except BufferError:  # a non-contiguous out-of-band buffer: fall back to in-band
        data, raws = pickle.dumps(obj, protocol=5), []
    if not raws:
        return _INLINE_PREFIX + data, []
    head = _HDR.pack(_FRAMED, len(raws), seq) + struct.pack(
        f"<{len(raws)}Q", *(r.nbytes for r in raws))
    return head + data, raws


class Header:
    """A decoded first message: inline, or the frames to expect."""

    __slots__ = ("payload", "seq", "sizes")

    def __init__(self, payload: memoryview, seq: int, sizes: tuple[int, ...]) -> None:
        self.payload, self.seq, self.sizes = payload, seq, sizes


def loads_inline(data: Any) -> Any:
    """The object of an inline message, or ``_FRAMED`` when it announces frames."""
    if data[0] == _INLINE:
        return _loads(memoryview(data)[1:])
    return _FRAMED_MARK


_FRAMED_MARK = object()
#: What :func:`loads_inline` returns for a message with payload frames.
FRAMED = _FRAMED_MARK


#: Sanity limits for a framed header from a peer (a corrupted or foreign message must
#: not make the receiver allocate absurd amounts): frames per message, bytes per frame.
MAX_FRAMES = 1 << 16
MAX_FRAME_BYTES = 1 << 40


def decode_header(data: Any) -> Header:
    """Parse a first message (``bytes``/``bytearray``/``uint8`` array).

    Raises
    ------
    ValueError
        Not an object message of this format (empty, unknown kind, truncated header,
        more than :data:`MAX_FRAMES` frames or a frame over :data:`MAX_FRAME_BYTES`):
        nothing is allocated for it.
    """
    n = len(data)
    if n == 0:
        raise ValueError("malformed object message: empty")
    kind = data[0]
    if kind == _INLINE:
        return Header(memoryview(data)[1:], 0, ())
    if kind != _FRAMED or n < _HDR.size:
        raise ValueError(f"malformed object message: kind {kind}, {n} bytes")
    _, nframes, seq = _HDR.unpack_from(data, 0)
    if nframes > MAX_FRAMES or n < _HDR.size + 8 * nframes:
        raise ValueError(f"malformed object message: {nframes} frames in {n} bytes")
    sizes = struct.unpack_from(f"<{nframes}Q", data, _HDR.size)
    if any(size > MAX_FRAME_BYTES for size in sizes):
        raise ValueError(f"malformed object message: a frame of {max(sizes)} bytes")
    return Header(memoryview(data)[_HDR.size + 8 * nframes:], seq, sizes)


def loads(header: Header, buffers: list[Any] | None = None) -> Any:
    """The object, built on ``buffers`` (the received frames) without copying them."""
    if not header.sizes:
        return pickle.loads(header.payload)
    return pickle.loads(header.payload, buffers=buffers)

"""The object codec: array payloads move without copies; the framing pair
(send_object/recv_object) round-trips and refuses hostile headers."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from ucxcomm._serialize import (
    CODECS,
    FRAMED,
    MAX_FRAME_BYTES,
    MAX_FRAMES,
    Header,
    MalformedObject,
    decode_header,
    encode,
    loads,
    loads_inline,
    recv_object,
    send_encoded,
    send_object,
)


def test_array_payload_is_out_of_band_on_both_sides():
    arr = np.arange(1 << 20, dtype=np.float64)
    message, frames = encode({"x": arr, "tag": "t"}, seq=7)
    assert len(message) < 1000  # the 8 MiB payload is not in the pickle
    assert len(frames) == 1
    # sender: the frame *is* the array's memory
    assert np.shares_memory(np.frombuffer(frames[0], dtype=np.uint8), arr)
    header = decode_header(bytearray(message))
    assert header.seq == 7 and header.sizes == (arr.nbytes,)
    assert loads_inline(bytearray(message)) is FRAMED
    # receiver: the object is built on the receive buffer, not a copy of it
    recv = np.empty(arr.nbytes, dtype=np.uint8)
    recv[:] = np.frombuffer(frames[0], dtype=np.uint8)
    obj = loads(header, [recv])
    assert np.shares_memory(obj["x"], recv) and obj["tag"] == "t"
    assert np.array_equal(obj["x"], arr)


def test_small_objects_are_inline():
    message, frames = encode({"a": [1, 2, 3]}, seq=0)
    assert frames == [] and message[0] == 0
    assert loads_inline(bytearray(message)) == {"a": [1, 2, 3]}


def test_non_contiguous_arrays_fall_back_in_band():
    arr = np.arange(100.0)[::2]
    message, frames = encode(arr, seq=0)
    assert frames == []
    assert np.array_equal(loads_inline(message), arr)


def test_unpicklable_is_a_type_error():
    with pytest.raises(TypeError, match="does not pickle"):
        encode(lambda: None, seq=0)


# ------------------------------------------------ the framing pair, on its own
class _Wire:
    """A fake link for send_object/recv_object: records (buffer, tag) per send and
    serves the frames back by tag, the way a communicator or a connection would."""

    FRAME_BASE = 1 << 40

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, int]] = []
        self.asked: list[Header] = []

    def send(self, buf, tag):
        self.sent.append((bytes(buf), tag))
        return None  # (done at once, as a send that completed in place)

    def frame_tag(self, seq):
        return self.FRAME_BASE + seq

    async def recv_frames(self, header):
        self.asked.append(header)
        ftag = self.frame_tag(header.seq)
        return [bytearray(buf) for buf, tag in self.sent[1:] if tag == ftag]

    async def refuse_frames(self, header):  # pragma: no cover - must not be called
        raise AssertionError(f"frames asked for a refused header {header.sizes}")


@pytest.mark.parametrize("codec", CODECS)
async def test_the_pair_round_trips_inline_objects_in_one_send(codec):
    wire = _Wire()
    value = {"a": [1, 2.5, "x"], "b": None}
    futs = send_object(wire.send, value, 7, wire.frame_tag, 3, codec)
    assert futs == [None] and [tag for _, tag in wire.sent] == [7]
    got, framed = await recv_object(wire.sent[0][0], wire.refuse_frames, codec)
    assert got == value and framed == 0


@pytest.mark.parametrize("codec", CODECS)
async def test_the_pair_round_trips_framed_objects(codec):
    wire = _Wire()
    arr = np.arange(10_000, dtype=np.float64)
    value = {"x": arr, "s": "t"}
    futs = send_object(wire.send, value, 7, wire.frame_tag, 5, codec)
    assert len(futs) == 2, "framed: the first message and one frame (seq is spent)"
    assert [tag for _, tag in wire.sent] == [7, wire.frame_tag(5)]
    got, framed = await recv_object(wire.sent[0][0], wire.recv_frames, codec)
    assert framed == arr.nbytes and got["s"] == "t" and np.array_equal(got["x"], arr)
    assert wire.asked[0].seq == 5 and wire.asked[0].sizes == (arr.nbytes,)
    assert wire.asked[0].codec == codec


def test_send_encoded_is_send_object_for_an_object_encoded_by_the_caller():
    a, b = _Wire(), _Wire()
    value = [np.ones(5000), np.zeros(3000)]
    send_object(a.send, value, 9, a.frame_tag, 2)
    message, frames = encode(value, 2)
    send_encoded(b.send, message, frames, 9, b.frame_tag(2))
    assert a.sent == b.sent and len(a.sent) == 3


def test_nothing_is_sent_for_an_object_the_codec_refuses():
    wire = _Wire()
    with pytest.raises(TypeError, match="does not pickle"):
        send_object(wire.send, lambda: None, 0, wire.frame_tag, 0)
    with pytest.raises(TypeError, match="safe codec"):
        send_object(wire.send, {"f": print}, 0, wire.frame_tag, 0, "safe")
    with pytest.raises(ValueError, match="codec"):
        send_object(wire.send, 1, 0, wire.frame_tag, 0, "json")
    assert wire.sent == []


@pytest.mark.parametrize("message", [
    encode({"evil": 1}, 0, "pickle")[0],  # inline pickle
    encode(np.arange(5000), 0, "pickle")[0],  # framed pickle
])
async def test_the_safe_side_refuses_a_pickle_before_anything(message):
    with pytest.raises(MalformedObject, match="pickle-encoded object; this side accepts"):
        await recv_object(message, _Wire().refuse_frames, "safe")


def _framed_header(kind, nframes, sizes, seq=0):
    return struct.pack("<BII", kind, nframes, seq) + struct.pack(f"<{len(sizes)}Q", *sizes)


@pytest.mark.parametrize(("message", "why"), [
    (b"", "empty"),
    (b"\x07abc", "kind 7"),
    (b"\x01\x02", "kind 1, 2 bytes"),  # truncated header
    (_framed_header(1, MAX_FRAMES + 1, [8] * (MAX_FRAMES + 1)), f"{MAX_FRAMES + 1} frames"),
    (_framed_header(1, 1 << 31, [8]), f"{1 << 31} frames"),  # (sizes not there either)
    (_framed_header(3, 3, [8, 8]), "3 frames in"),  # sizes cut short
    (_framed_header(1, 2, [8, MAX_FRAME_BYTES + 1]), "a frame of"),
])
async def test_hostile_headers_are_refused_before_frames_are_asked_for(message, why):
    with pytest.raises(MalformedObject, match=why):
        await recv_object(message, _Wire().refuse_frames)


async def test_a_header_announcing_more_than_max_bytes_allocates_nothing():
    """4096 frames of 1 TiB each (every frame within MAX_FRAME_BYTES, 4 PiB in all):
    refused on the sum before any frame is asked for, with no allocation of note."""
    message = _framed_header(3, MAX_FRAMES, [MAX_FRAME_BYTES] * MAX_FRAMES) + b"N"
    tracemalloc.start()
    try:
        with pytest.raises(MalformedObject, match="announcing"):
            await recv_object(message, _Wire().refuse_frames, "safe", max_bytes=1 << 40)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


async def test_a_malformed_safe_body_is_refused_and_the_frames_checked():
    wire = _Wire()
    # A safe framed body that uses no frame although one was announced.
    message = _framed_header(3, 1, [4]) + b"N"
    wire.sent = [(message, 7), (b"abcd", wire.frame_tag(0))]
    with pytest.raises(MalformedObject, match="1 frames, 0 used"):
        await recv_object(message, wire.recv_frames, "safe")
    with pytest.raises(MalformedObject, match="unknown type code"):
        await recv_object(b"\x02?", wire.refuse_frames, "safe")


async def test_an_objects_own_value_error_is_not_a_malformed_message():
    """What unpickling raises is the object's (a connection refuses its peer only for
    MalformedObject)."""
    message = encode(_RaisesOnLoad(), 0)[0]
    with pytest.raises(ValueError, match="invalid literal") as info:
        await recv_object(message, _Wire().refuse_frames, "pickle")
    assert not isinstance(info.value, MalformedObject)


class _RaisesOnLoad:
    def __reduce__(self):
        return int, ("not a number",)

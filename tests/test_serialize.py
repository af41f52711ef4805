"""The object wire format moves array payloads without copying them."""

from __future__ import annotations

import numpy as np
import pytest

from ucxcomm._serialize import FRAMED, decode_header, encode, loads, loads_inline


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

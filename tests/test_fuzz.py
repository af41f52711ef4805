"""Hostile and corrupted input, generated (hypothesis): the bootstrap store's protocol
before and after authentication, the object-message header a peer sends, and remote keys.
Every case must end in a clean refusal (a closed connection, ValueError) within its
deadline: no crash, no traceback, no unbounded buffering or allocation."""

from __future__ import annotations

import asyncio
import json
import logging
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucxcomm._serialize import MAX_FRAME_BYTES, MAX_FRAMES, decode_header, encode, loads
from ucxcomm.launch.store import MAX_AUTH_FRAME, StoreClient, StoreServer

pytestmark = pytest.mark.timeout(300)

TOKEN = "fuzz-token"
CASES = settings(max_examples=1000, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
STORE_CASES = settings(max_examples=300, deadline=None,
                       suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
# Requests shaped like the real ones, with the wrong types, keys and values.
requests = st.fixed_dictionaries(
    {"op": st.sampled_from(["set", "get", "add", "join", "leave", "auth", "nope"])},
    optional={"id": json_values, "key": json_values, "value": json_values,
              "amount": json_values, "rank": json_values, "token": json_values})


def _frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _exchange(port: int, data: bytes, auth: bool) -> None:
    """Send ``data`` (after authenticating, if ``auth``), then end the stream: the store
    must answer what it can and close its side (at most 5 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if auth:
            writer.write(_frame(json.dumps({"op": "auth", "token": TOKEN}).encode()))
        writer.write(data)
        writer.write_eof()
        await writer.drain()
        async with asyncio.timeout(5):
            while await reader.read(65536):
                pass
    except ConnectionError:
        pass
    finally:
        writer.close()


def _fuzz_store(payloads: list[tuple[bytes, bool]]) -> None:
    async def run() -> None:
        errors = _Errors()
        logging.getLogger().addHandler(errors)
        loop = asyncio.get_running_loop()
        loop_errors: list[dict] = []
        loop.set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
        server = await StoreServer(TOKEN, "127.0.0.1", 0).start()
        try:
            for data, auth in payloads:
                await _exchange(server.port, data, auth)
            good = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
            await good.set("still", b"serving")
            assert await good.get("still") == b"serving"
            await good.close()
        finally:
            await server.close()
            logging.getLogger().removeHandler(errors)
        assert not errors.records, [r.getMessage() for r in errors.records]
        assert not loop_errors, loop_errors

    asyncio.run(run())


@STORE_CASES
@given(st.binary(max_size=256), st.integers(0, (1 << 32) - 1))
def test_store_survives_raw_bytes_before_auth(junk, length):
    """Any header and bytes as the first frame: refused and closed, never buffered
    beyond the auth limit."""
    _fuzz_store([(struct.pack("!I", length) + junk, False), (junk, False)])


@STORE_CASES
@given(st.lists(st.tuples(requests, st.booleans()), min_size=1, max_size=4))
def test_store_survives_malformed_requests(reqs):
    """JSON requests with wrong types and keys, before and after authentication."""
    _fuzz_store([(_frame(json.dumps(r).encode()), auth) for r, auth in reqs])


@STORE_CASES
@given(json_values)
def test_store_survives_any_json_as_first_frame(value):
    data = json.dumps(value).encode()
    if len(data) <= MAX_AUTH_FRAME:
        _fuzz_store([(_frame(data), False)])


@CASES
@given(st.binary(max_size=512))
def test_object_header_is_parsed_or_refused(data):
    """What a peer sends as the first message of an object: either a header whose frame
    sizes are within limits, or ValueError (nothing allocated)."""
    try:
        header = decode_header(data)
    except ValueError:
        return
    assert len(header.sizes) <= MAX_FRAMES
    assert all(0 <= s <= MAX_FRAME_BYTES for s in header.sizes)


@CASES
@given(st.integers(0, (1 << 32) - 1), st.lists(st.integers(0, (1 << 64) - 1), max_size=8),
       st.binary(max_size=64))
def test_object_header_with_absurd_frames_is_refused(nframes, sizes, payload):
    data = struct.pack("<BII", 1, nframes, 7) + struct.pack(f"<{len(sizes)}Q", *sizes)
    data += payload
    try:
        header = decode_header(data)
    except ValueError:
        return
    assert len(header.sizes) == nframes <= len(sizes) + len(payload) // 8
    assert all(s <= MAX_FRAME_BYTES for s in header.sizes)


def test_object_header_round_trip():
    import numpy as np

    msg, frames = encode({"a": np.arange(10)}, 3)
    header = decode_header(msg)
    assert header.seq == 3 and header.sizes == (80,)
    assert (loads(header, [bytes(f) for f in frames])["a"] == np.arange(10)).all()


@CASES
@given(st.binary(max_size=300))
def test_remote_key_is_parsed_or_refused(data):
    """A remote key (from a peer, or the user) is parsed into sections or refused with
    ValueError before UCX sees it."""
    from ucxcomm.transport.rma import _parse_rkey

    for blob in (data, b"UCR3" + data):
        try:
            sections = _parse_rkey(blob)
        except ValueError:
            continue
        assert sections and all(len(s) == 4 for s in sections)

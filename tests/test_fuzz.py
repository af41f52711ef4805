"""Hostile and corrupted input, generated (hypothesis): the bootstrap store's protocol
before and after authentication, the object-message header a peer sends, remote keys,
and what a rank-less connection's peer sends (handshake, worker addresses, packed UCX
keys, stream headers, safe-codec objects, signals).
Every case must end in a clean refusal (a closed connection, ValueError) within its
deadline: no crash, no traceback, no unbounded buffering or allocation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
from typing import Any

import numpy as np
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


@contextlib.asynccontextmanager
async def _no_errors() -> Any:
    """Fails the test if anything was logged at ERROR or reached the event loop's
    exception handler meanwhile."""
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    loop_errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, ctx: loop_errors.append(ctx))
    try:
        yield
    finally:
        logging.getLogger().removeHandler(errors)
    assert not errors.records, [r.getMessage() for r in errors.records]
    assert not loop_errors, loop_errors


def _fuzz_store(payloads: list[tuple[bytes, bool]]) -> None:
    async def run() -> None:
        async with _no_errors():
            server = await StoreServer(TOKEN, "127.0.0.1", 0).start()
            try:
                for data, auth in payloads:
                    await _exchange(server.port, data, auth)
                good = await StoreClient.connect("127.0.0.1", server.port, TOKEN,
                                                 timeout=10)
                await good.set("still", b"serving")
                assert await good.get("still") == b"serving"
                await good.close()
            finally:
                await server.close()

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


# ------------------------------------------------------- rank-less connections (issue 27)
# What a peer of ucxtransport.listen/connect sends before and after the handshake: the
# handshake's frames, worker addresses and remote keys (checked before UCX sees them),
# stream headers, safe-codec objects and signals.
from ucxcomm._serialize import Header  # noqa: E402
from ucxcomm.errors import ProtocolError  # noqa: E402
from ucxcomm.transport.wire import (  # noqa: E402
    address_entries,
    check_address,
    check_rkey_layout,
    rkey_layout,
)


@pytest.fixture(scope="module")
def real_address():
    """A worker address of this machine's UCX (the template and a mutation seed)."""
    from ucxcomm.transport.worker import Worker

    async def make() -> tuple[bytes, bytes]:
        worker = Worker()
        try:
            key = worker._rma.engine(False).template_key()
            return worker.address, key
        finally:
            await worker.close()

    return asyncio.run(make())


@CASES
@given(st.binary(max_size=600))
def test_worker_address_is_walked_or_refused(data):
    try:
        _, entries = address_entries(data)
    except ValueError:
        return
    assert 0 < len(entries) <= 128
    assert all(e.md_index < 64 for e in entries)


@CASES
@given(st.data())
def test_mutated_worker_address_is_checked_or_refused(real_address, data):
    """Bytes flipped, cut, inserted into a real address: ``check_address`` says yes or
    no (ValueError), never anything else, and what it accepts walks to its end."""
    address = bytearray(real_address[0])
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "set"]))
        pos = data.draw(st.integers(0, len(address)))
        if op == "flip" and pos < len(address):
            address[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del address[pos:pos + data.draw(st.integers(1, 16))]
        elif op == "insert":
            address[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif pos < len(address):
            address[pos] = data.draw(st.integers(0, 255))
    try:
        check_address(bytes(address), real_address[0], (), os.getpid())
    except ValueError:
        return
    address_entries(bytes(address))


@CASES
@given(st.binary(max_size=200))
def test_packed_key_layout_is_read_or_refused(real_address, data):
    try:
        md_map, _, sizes, _ = rkey_layout(data)
    except ValueError:
        return
    assert md_map and len(sizes) == bin(md_map).count("1")
    try:
        check_rkey_layout(data, real_address[1])
    except ValueError:
        return
    assert rkey_layout(data) == rkey_layout(real_address[1])


@CASES
@given(st.binary(max_size=400))
def test_stream_header_is_parsed_or_refused(data):
    from ucxcomm.pipes.stream import MAX_ARRAYS, _parse_header

    for payload in (data, b"\x01\x00" + data, b"\x01\x02" + data):
        try:
            specs, _ = _parse_header(payload, "safe", 1 << 32)
        except ProtocolError:
            continue
        assert len(specs) <= MAX_ARRAYS
        assert sum(nbytes for _, _, _, nbytes in specs) <= 1 << 32
        for dtype, shape, _, nbytes in specs:
            assert not dtype.hasobject and dtype.itemsize * int(np.prod(shape)) == nbytes


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 200), 1 << 200) | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10) | st.complex_numbers(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5) | st.integers(-(1 << 63), (1 << 63) - 1), inner,
                      max_size=4)
    | st.frozensets(st.integers(-(1 << 63), (1 << 63) - 1) | st.text(max_size=4),
                    max_size=4),
    max_leaves=16)


def _same(a, b) -> bool:
    """Equal and of the same types all the way down (floats bit for bit: NaN, -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@CASES
@given(plain)
def test_safe_codec_round_trips_plain_data(value):
    message, frames = encode(value, 0, "safe")
    got = loads(decode_header(message), [bytes(f) for f in frames])
    assert _same(got, value), (got, value)


@CASES
@given(st.binary(max_size=300), st.lists(st.binary(max_size=64), max_size=3))
def test_safe_codec_message_is_decoded_or_refused(data, frames):
    """Any body as a safe-codec object, with any frames: an object or ValueError; never
    a pickle, never an object array."""
    header = Header(memoryview(data), 0, tuple(len(f) for f in frames), "safe")
    try:
        obj = loads(header, list(frames))
    except ValueError:
        return
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, np.ndarray):
            assert not item.dtype.hasobject
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)


def _fuzz_listener(payloads: list[tuple[bytes, bool]]) -> None:
    """Each payload to a fresh connection of an in-process listener (after a valid
    opening frame when flagged); then a real client must still be served, the handler
    must never have run for the fuzz, and nothing may be logged at ERROR."""
    from ucxcomm.pipes.listener import _ANSWER, _MAGIC, _OPEN, _VERSION
    from ucxcomm.transport import connect, listen

    async def run() -> None:
        served = []
        real = asyncio.Event()

        async def handler(ep):
            served.append(await ep.recv_obj())
            real.set()
            await ep.close()

        async with _no_errors(), await listen(handler, timeout=2) as lst:
            for data, opened in payloads:
                reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
                try:
                    if opened:
                        writer.write(_OPEN.pack(_MAGIC, _VERSION, 0, bytes(32)))
                        await reader.readexactly(_ANSWER.size)
                    writer.write(data)
                    writer.write_eof()
                    async with asyncio.timeout(5):
                        while await reader.read(65536):
                            pass
                except (ConnectionError, asyncio.IncompleteReadError):
                    pass
                finally:
                    writer.close()
            assert not served
            ep = await connect("127.0.0.1", lst.port, timeout=10)
            await ep.send_obj("real")
            await ep.close()
            await asyncio.wait_for(real.wait(), 10)
            assert served == ["real"]

    asyncio.run(run())


@STORE_CASES
@given(st.binary(max_size=300), st.booleans())
def test_listener_survives_any_bytes_in_its_handshake(data, opened):
    _fuzz_listener([(data, opened)])


@STORE_CASES
@given(st.integers(0, (1 << 32) - 1), st.binary(max_size=100))
def test_listener_survives_any_hello(length, body):
    """A hello of any announced length and body after a valid opening."""
    _fuzz_listener([(struct.pack("<I", length) + body, True)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64))
def test_signal_of_any_size_is_delivered_only_whole(payload):
    from ucxcomm.tags import CONN_SIGNAL as _SIGNAL_TAG
    from ucxcomm.transport import connect, listen

    async def run() -> None:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def handler(ep):
            try:
                got.set_result(await ep.recv_signal())
            except ProtocolError as exc:
                got.set_result(exc)
            await ep.close()

        async with await listen(handler) as lst:
            ep = await connect("127.0.0.1", lst.port, timeout=10)
            fut = ep.isend(payload, (ep._send_ns << 32) | _SIGNAL_TAG)
            if fut is not None:
                await fut
            res = await asyncio.wait_for(got, 10)
            await ep.close()
        if len(payload) == 24:
            assert tuple(res) == struct.unpack("<QQq", payload)
        else:
            assert isinstance(res, ProtocolError)

    asyncio.run(run())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_addresses_the_check_accepts_never_crash_ucx(seed):
    """The check lets through well-formed addresses with wrong contents (another port,
    segment, process): handed to UCX (endpoint, a send, close) they fail or go nowhere,
    they never crash it. Run in its own process; 500 mutations of a real address per
    seed (about 400 accepted, some refused by UCX itself)."""
    import subprocess
    import sys
    from pathlib import Path

    prog = Path(__file__).resolve().parent / "ucx_address_prog.py"
    res = subprocess.run([sys.executable, str(prog), str(seed), "500"], capture_output=True,
                         text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    tried = [int(ln.split()[1]) for ln in res.stdout.splitlines() if ln.startswith("TRIED")]
    assert tried and tried[0] > 100, res.stdout[-2000:]

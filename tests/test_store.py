"""The bootstrap store: token admission, waiting gets, counters, liveness events."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from ucxcomm import BootstrapError, CommTimeoutError
from ucxcomm.launch.store import StoreClient, StoreServer

TOKEN = "s3cret-token"


@pytest.fixture
async def server():
    srv = await StoreServer(TOKEN, "127.0.0.1", 0).start()
    yield srv
    await srv.close()


async def test_set_get_add(server):
    a = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
    b = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
    waiting = asyncio.ensure_future(b.get("k", timeout=10))  # set later by a
    await a.set("k", b"\x00\x01value")
    assert await waiting == b"\x00\x01value"
    assert await a.add("n", 2) == 2
    assert await b.add("n", 3) == 5
    await a.close()
    await b.close()


async def test_get_times_out(server):
    c = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
    with pytest.raises(CommTimeoutError):
        await c.get("never-set", timeout=0.1)
    await c.close()


async def test_wrong_token_is_refused(server):
    good = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
    await good.set("secret", b"top")
    with pytest.raises(BootstrapError, match="refused"):
        await StoreClient.connect("127.0.0.1", server.port, "wrong", timeout=10)
    await good.close()


def _frame(msg: dict) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack("!I", len(data)) + data


async def test_client_without_token_cannot_read_or_write(server):
    good = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
    await good.set("secret", b"top")
    # A raw client that skips authentication and goes straight to get/set.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(_frame({"op": "set", "id": 1, "key": "secret", "value": "ZXZpbA=="}))
    writer.write(_frame({"op": "get", "id": 2, "key": "secret"}))
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)  # server answers once, then closes
    (n,) = struct.unpack("!I", data[:4])
    reply = json.loads(data[4:4 + n])
    assert reply == {"ok": False, "error": "bad or missing job token"}
    assert len(data) == 4 + n  # nothing else: no value leaked
    writer.close()
    assert await good.get("secret") == b"top"  # the rogue set did not happen
    await good.close()


async def test_dead_and_left_ranks(server):
    watcher = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
    dead = asyncio.get_running_loop().create_future()
    watcher.on_dead = lambda r: dead.set_result(r) if not dead.done() else None
    leaver = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
    victim = await StoreClient.connect("127.0.0.1", server.port, TOKEN, timeout=10)
    await leaver.join(1)
    await victim.join(2)
    await leaver.leave()
    await leaver.close()
    victim._writer.transport.abort()  # the rank dies: connection drops without leave
    assert await asyncio.wait_for(dead, 10) == 2
    await server.wait_until_gone(2, timeout=10)
    assert server.left == [1] and server.dead == [2]
    await watcher.close()


async def test_connect_times_out_when_no_store():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(CommTimeoutError, match="unreachable"):
        await StoreClient.connect("127.0.0.1", port, TOKEN, timeout=0.3)

"""Rank-less endpoints under attack (issue 27): every row of the issue's table, against
a listener in its own process (tests/security_prog.py) written as the docs show.

Each test plays a client holding nothing but the port (or a wrong token), does what the
row says, and checks what must hold: no command ran, the listener is alive and serves a
legitimate client afterwards, its memory and descriptors stay within the stated bound,
and its handler saw only what it should have.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import pickle
import socket
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import ucxcomm
from ucxcomm import AuthenticationError, UcxCommError
from ucxcomm._net import host_identity
from ucxcomm.pipes.connection import _REGION
from ucxcomm.pipes.listener import _ANSWER, _MAGIC, _OPEN, _VERSION
from ucxcomm.pipes.stream import _pack_header
from ucxcomm.tags import CONN_OBJ as _OBJ_TAG
from ucxcomm.tags import CONN_REGION as _REGION_TAG
from ucxcomm.tags import CONN_SIGNAL as _SIGNAL_TAG
from ucxcomm.transport import connect, default_worker, listen
from ucxcomm.transport.base import FULL_MASK

ROOT = Path(__file__).resolve().parent.parent
PROG = str(Path(__file__).resolve().parent / "security_prog.py")
MiB = 1 << 20

pytestmark = pytest.mark.timeout(180)


class Evil:
    """Unpickling it runs a shell command that creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class Victim:
    """A listener process (tests/security_prog.py) and its reports."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port
        self.events: asyncio.Queue[dict] = asyncio.Queue()
        self.stats_q: asyncio.Queue[dict] = asyncio.Queue()
        self.lines: list[str] = []
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, mode: str, *args: str) -> Victim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, PROG, mode, *args, cwd=ROOT, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            line = (await proc.stdout.readline()).decode()
        if not line.startswith("PORT "):
            err = await proc.stderr.read() if proc.stderr else b""
            raise AssertionError(f"victim did not start: {line!r}\n{err.decode()[-3000:]}")
        return cls(proc, int(line.split()[1]))

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := (await self.proc.stdout.readline()).decode():
            self.lines.append(line)
            if line.startswith("EVENT "):
                await self.events.put(json.loads(line[6:]))
            elif line.startswith("STATS "):
                await self.stats_q.put(json.loads(line[6:]))

    async def event(self, timeout: float = 30) -> dict:
        try:
            async with asyncio.timeout(timeout):
                return await self.events.get()
        except TimeoutError:
            raise AssertionError(f"no event from the victim; alive: {self.alive}; "
                                 f"output {self.lines[-5:]}") from None

    async def stats(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stats\n")
        async with asyncio.timeout(30):
            return await self.stats_q.get()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def settle(self, key: str, target: int, timeout: float = 15) -> dict:
        """Poll the victim's stats until ``stats[key] <= target`` (or the deadline)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            st = await self.stats()
            if st[key] <= target or loop.time() > deadline:
                return st
            await asyncio.sleep(0.2)

    async def stop(self) -> str:
        """End it; its stderr. It must exit cleanly (it never crashed)."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        if self.alive:
            self.proc.stdin.write(b"exit\n")
        async with asyncio.timeout(30):
            code = await self.proc.wait()
            err = (await self.proc.stderr.read()).decode()
        self._task.cancel()
        assert code == 0, f"the victim died: exit {code}\n{err[-3000:]}"
        return err

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()


@pytest.fixture
async def victims():
    started: list[Victim] = []

    async def start(mode: str, *args: str) -> Victim:
        v = await Victim.start(mode, *args)
        started.append(v)
        return v

    yield start
    for v in started:
        if v.alive:
            v.kill()
            await v.proc.wait()
        v._task.cancel()


async def send_raw(ep, payload, tag: int) -> None:
    """``payload`` as one message on the connection's tag ``tag`` (the peer's namespace
    added), bypassing what our own senders would check."""
    fut = ep.isend(payload, (ep._send_ns << 32) | tag)
    if fut is not None:
        await fut


def report(row: str, before: dict, after: dict) -> None:
    """The figures the issue asks for (``pytest -s`` shows them)."""
    print(f"\n{row}: listener RSS {before['rss'] / MiB:.1f} -> {after['rss'] / MiB:.1f} MiB, "
          f"address space {before['vm'] / MiB:.0f} -> {after['vm'] / MiB:.0f} MiB, "
          f"open fds {before['fds']} -> {after['fds']}")


async def legit_object_round(victim: Victim, **kw) -> None:
    """A legitimate client is still served: its object arrives."""
    ep = await connect("127.0.0.1", victim.port, timeout=30, **kw)
    await ep.send_obj({"hello": [1, 2.5, "x"], "a": np.arange(3)})
    ev = await victim.event()
    assert ev["kind"] == "obj" and ev["type"] == "dict", ev
    await ep.close()
    assert (await victim.event())["kind"] == "error"  # (its handler sees it leave)


# ---------------------------------------------------------------------- S1, S2
async def test_s1_pickled_object_is_never_unpickled_without_a_token(victims, tmp_path):
    victim = await victims("obj")
    before = await victim.stats()
    pwned = tmp_path / "pwned"
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    assert not ep.authenticated
    await ep.send_obj(Evil(str(pwned)), codec="pickle")
    ev = await victim.event()
    assert ev["kind"] == "error" and ev["error"] == "ProtocolError", ev
    assert "pickle" in ev["msg"]
    await ep.close()
    # The same by hand: our framing, a pickle, on the object tag.
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    await send_raw(ep, b"\x00" + pickle.dumps(Evil(str(pwned))), _OBJ_TAG)
    ev = await victim.event()
    assert ev["error"] == "ProtocolError", ev
    await ep.close()
    assert not pwned.exists(), "the pickle ran"  # (it would have, before the error)
    await legit_object_round(victim)
    report("S1: pickled objects, no token", before, await victim.stats())
    await victim.stop()


async def test_s1_a_token_listener_runs_its_handler_only_for_token_holders(victims):
    victim = await victims("obj", "--token", "s3cret")
    with pytest.raises(AuthenticationError, match="requires a token"):
        await connect("127.0.0.1", victim.port, timeout=30)
    with pytest.raises(AuthenticationError, match="another token"):
        await connect("127.0.0.1", victim.port, token="wrong", timeout=30)
    assert (await victim.stats())["calls"] == 0, "the handler saw an unauthenticated client"
    ep = await connect("127.0.0.1", victim.port, token="s3cret", timeout=30)
    assert ep.authenticated
    # Between authenticated peers pickle is the default: a type the safe codec lacks.
    await ep.send_obj(collections.OrderedDict(a=1))
    ev = await victim.event()
    assert ev["type"] == "OrderedDict", ev
    await ep.close()
    err = await victim.stop()
    assert err.count("refused a client") >= 1, err  # one line per refusal (rate-limited)
    assert "Traceback" not in err, err


async def test_s2_stream_meta_is_never_unpickled_without_a_token(victims, tmp_path):
    victim = await victims("stream")
    before = await victim.stats()
    pwned = tmp_path / "pwned"
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    async with ep.stream_writer(codec="pickle") as tx:
        await tx.send(np.ones(4), meta=Evil(str(pwned)))
    ev = await victim.event()
    assert ev["kind"] == "error" and ev["error"] == "ProtocolError", ev
    await ep.close()
    assert not pwned.exists()
    # A polite writer is served: meta in the safe codec, arrays intact.
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    async with ep.stream_writer() as tx:
        await tx.send([np.ones(4), np.full((2, 3), 2.0)], meta={"index": 1})
    ev = await victim.event()
    assert ev["kind"] == "batch" and ev["sums"] == [4.0, 12.0] and "index" in ev["meta"]
    assert (await victim.event())["kind"] == "end"
    await ep.close()
    report("S2: pickled stream meta, no token", before, await victim.stats())
    await victim.stop()


async def test_s2_the_shipped_consumer_refuses_a_malicious_producer(tmp_path):
    pwned = tmp_path / "pwned"

    async def producer(ep):
        try:
            async with ep.stream_writer(codec="pickle") as tx:
                await tx.send(np.ones(4, np.float32), meta=Evil(str(pwned)))
            await ep.recv_obj()
        except ucxcomm.PeerFailure:
            pass
        finally:
            await ep.close()

    async with await listen(producer) as lst:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "examples/pipeline/consumer.py", "--port", str(lst.port),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={k: v for k, v in os.environ.items() if k != "UCXCOMM_PIPELINE_TOKEN"})
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode != 0
    assert b"ProtocolError" in err, err.decode()[-2000:]
    assert not pwned.exists()


# ------------------------------------------------------------------------- S3
async def _raw_client(port: int, hello_address: bytes, identity: bytes | None = None
                      ) -> bytes:
    """Our handshake by hand (no token), with any worker address; what the listener
    answers after the hello (b"" when it hangs up)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_OPEN.pack(_MAGIC, _VERSION, 0, os.urandom(32)))
        answer = await reader.readexactly(_ANSWER.size)
        assert answer[:4] == _MAGIC
        ident = host_identity() if identity is None else identity
        rest = struct.pack("<IHI", 12345, len(ident), len(hello_address)) + ident \
            + hello_address
        writer.write(struct.pack("<I", len(rest)) + rest)
        async with asyncio.timeout(20):
            return await reader.read(65536)
    finally:
        writer.close()


async def test_s3_a_forged_worker_address_never_reaches_ucx(victims):
    victim = await victims("obj")
    before = await victim.stats()
    real = default_worker().address
    forged = [os.urandom(200), os.urandom(3), real[:40], real + b"\x00",
              bytes([real[0] ^ 0x01]) + real[1:],  # another address version
              real[:9] + b"\xff" + real[10:]]  # a memory-domain index past UCX's maps
    for address in forged:
        assert await _raw_client(victim.port, address) == b""  # dropped at once
    assert victim.alive
    assert (await victim.stats())["calls"] == 0
    await legit_object_round(victim)
    report("S3: forged worker addresses", before, await victim.stats())
    await victim.stop()


# ------------------------------------------------------------------------- S4
async def _send_region_message(ep, address: int, nbytes: int, rkey: bytes) -> None:
    await send_raw(ep, _REGION.pack(address, nbytes) + rkey, _REGION_TAG)


async def test_s4_forged_region_keys_are_refused(victims):
    victim = await victims("region")
    before = await victim.stats()
    worker = default_worker()
    good = worker.allocate(1 << 16)
    section = struct.pack("<BII", 0, 40, 30) + os.urandom(70)
    for rkey in (b"UCR3" + os.urandom(100),  # right magic, garbage body
                 struct.pack("<4sB", b"UCR3", 1) + section,  # well framed, garbage inside
                 good.rkey[:-3]):  # a genuine key, cut short
        ep = await connect("127.0.0.1", victim.port, timeout=30)
        await _send_region_message(ep, good.address, 4096, rkey)
        ev = await victim.event()
        assert ev["kind"] == "error" and ev["error"] == "ProtocolError", ev
        await ep.close()
    assert victim.alive
    good.close()
    report("S4: forged region keys", before, await victim.stats())
    await victim.stop()


async def test_s4_a_genuine_key_with_a_false_address_never_writes_into_the_victim(victims):
    """A genuine key of memory UCX allocated, sent with a false address (page 1, never
    mapped): the victim mapped such keys and copied at the pointer the address gave
    inside its own address space (a crash, or a silent write). Now keys from a
    connection are used through their registered sections only: the put goes to the
    attacker's process, where that address fails."""
    victim = await victims("region")
    before = await victim.stats()
    worker = default_worker()
    region = worker.allocate(1 << 16)
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    await _send_region_message(ep, 4096, 1 << 16, region.rkey)
    ev = await victim.event()
    assert ev["kind"] == "remote" and ev["direct"] is False, ev
    ev = await victim.event()
    assert ev["kind"] == "error" and ev["error"] == "PeerFailure", ev
    await ep.close()
    assert victim.alive
    region.close()
    report("S4: a genuine key, a false address", before, await victim.stats())
    await victim.stop()


async def _victims_key(ep) -> tuple[int, int, bytes]:
    """The region message the victim sent us, raw: ``(address, nbytes, rkey)``."""
    worker = ep._worker
    res = worker.recv_alloc((ep._recv_ns << 32) | _REGION_TAG, FULL_MASK, ep._peers)
    if type(res) is not tuple:
        res = await worker.complete(res)
    data = bytes(res[2])
    address, nbytes = _REGION.unpack_from(data)
    return address, nbytes, data[_REGION.size:]


async def test_s4_a_key_naming_the_victims_own_process_is_refused(victims):
    """The victim's own key sent back to it for memory outside its region (its put would
    copy into its own memory wherever the attacker says): refused. For its own region
    the key is its own memory, and the put lands there, as a connection to oneself
    would do."""
    victim = await victims("region")
    before = await victim.stats()
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    address, nbytes, rkey = await _victims_key(ep)
    await _send_region_message(ep, address - (1 << 20), 1 << 16, rkey)
    ev = await victim.event()
    assert ev["error"] == "ProtocolError" and "own memory" in ev["msg"], ev
    await ep.close()
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    address, nbytes, rkey = await _victims_key(ep)
    await _send_region_message(ep, address, nbytes, rkey)
    assert (await victim.event())["kind"] == "remote"
    ev = await victim.event()
    assert ev["kind"] == "put" and not ev["canary_intact"], ev  # (its own 0xAB bytes)
    await ep.close()
    report("S4: keys naming the listener itself", before, await victim.stats())
    await victim.stop()


# --------------------------------------------------------------------- S5, S6
def _object_header(nframes: int, size: int) -> bytes:
    """A framed safe-codec object header (kind 3) announcing ``nframes`` of ``size``."""
    return struct.pack("<BII", 3, nframes, 0) + struct.pack(f"<{nframes}Q",
                                                          *[size] * nframes) + b"N"


async def _send_object_message(ep, message: bytes) -> None:
    await send_raw(ep, message, _OBJ_TAG)


async def test_s5_s6_object_headers_that_announce_what_never_comes(victims):
    victim = await victims("obj")
    before = await victim.stats()
    # 41,000 frames of 1 GiB: refused at once.
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    await _send_object_message(ep, _object_header(41_000, 1 << 30))
    ev = await victim.event()
    assert ev["error"] == "ProtocolError" and "41000 frames" in ev["msg"], ev
    await ep.close()
    # Within the limits (4096 frames of 256 MiB: 1 TiB announced) but no payload: the
    # victim waits for frames that never come, allocating nothing meanwhile.
    waiting = []
    for _ in range(5):
        ep = await connect("127.0.0.1", victim.port, timeout=30)
        await _send_object_message(ep, _object_header(4096, 256 * MiB))
        waiting.append(ep)
    # 20 small headers of 4096 frames each (S6): nothing allocated for them either.
    for _ in range(20):
        ep = await connect("127.0.0.1", victim.port, timeout=30)
        await _send_object_message(ep, _object_header(4096, 16))
        waiting.append(ep)
    await legit_object_round(victim)  # a legitimate client is served meanwhile
    during = await victim.stats()
    assert during["vm"] - before["vm"] < 1024 * MiB, (before, during)
    assert during["rss"] - before["rss"] < 64 * MiB, (before, during)
    report("S5/S6: headers announcing 1 TiB each, no payload (waiting)", before, during)
    for ep in waiting:
        await ep.close()
    for _ in waiting:
        assert (await victim.event())["error"] == "PeerFailure"
    await victim.stop()


# ------------------------------------------------------------------- S7, S8, W1
def _batch_header(specs, meta=None) -> bytes:
    return _pack_header(specs, meta, "safe")


async def _raw_batch(ep, header: bytes, arrays=()) -> list:
    futs = [ep.isend(header, ep._stream_tag(0, 0, send=True))]
    futs += [ep.isend(a, ep._stream_tag(0, 1, send=True)) for a in arrays]
    return [f for f in futs if f is not None]


async def test_s7_a_stream_header_with_too_many_arrays_is_refused(victims):
    victim = await victims("stream")
    before = await victim.stats()
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    u1 = np.dtype(np.uint8)
    await asyncio.gather(*await _raw_batch(ep, _batch_header([(u1, (1,), False, 1)] * 20_000)))
    ev = await victim.event()
    assert ev["error"] == "ProtocolError" and "arrays" in ev["msg"], ev
    after = await victim.stats()
    report("S7: a stream header of 20,000 arrays", before, after)
    assert after["rss"] - before["rss"] < 32 * MiB, (before, after)
    await ep.close()
    await victim.stop()


@pytest.mark.parametrize("mode,size", [("hold", 1 << 16), ("stream", 1024)])
async def test_s8_a_writer_ignoring_credits_is_refused_within_the_window(victims, mode,
                                                                          size):
    """3,000 batches without waiting for credits, to a consumer that reads nothing
    (the reader took every header and received its data: +192 MiB at window=4) or
    to one that keeps up: refused at the first batch beyond the credits."""
    victim = await victims(mode)
    before = await victim.stats()
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    header = _batch_header([(np.dtype(np.uint8), (size,), False, size)])
    data = np.ones(size, np.uint8)
    futs = []
    for _ in range(3000):
        futs += await _raw_batch(ep, header, [data])
    while (ev := await victim.event())["kind"] == "batch":
        pass
    assert ev["error"] == "ProtocolError" and "credits" in ev["msg"], ev
    for f in futs:
        f.add_done_callback(lambda f: f.cancelled() or f.exception())
    after = await victim.settle("rss", before["rss"] + 32 * MiB)
    report(f"S8: 3,000 batches of {size} B past the credits ({mode})", before, after)
    assert after["rss"] - before["rss"] < 32 * MiB, (before, after)
    await ep.close()
    if mode == "stream":
        await legit_object_round_stream(victim)
    await victim.stop()


async def legit_object_round_stream(victim: Victim) -> None:
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    async with ep.stream_writer() as tx:
        await tx.send(np.ones(8))
    assert (await victim.event())["kind"] == "batch"
    assert (await victim.event())["kind"] == "end"
    await ep.close()


async def test_w1_a_batch_of_another_size_than_announced_is_refused(victims):
    victim = await victims("stream")
    before = await victim.stats()
    u1 = np.dtype(np.uint8)
    # Announces 1 MiB, sends 16 B (was: delivered, ending in the previous batch's bytes).
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    await asyncio.gather(*await _raw_batch(ep, _batch_header([(u1, (MiB,), False, MiB)]),
                                           [np.full(MiB, 3, np.uint8)]))
    ev = await victim.event()
    assert ev["kind"] == "batch", ev
    await asyncio.gather(*await _raw_batch(ep, _batch_header([(u1, (MiB,), False, MiB)]),
                                           [np.zeros(16, np.uint8)]))
    ev = await victim.event()
    assert ev["error"] == "ProtocolError" and "16 bytes" in ev["msg"], ev
    await ep.close()
    # A longer message than announced, and sizes that do not add up (-5 bytes).
    for specs, data in (([(u1, (16,), False, 16)], np.zeros(MiB, np.uint8)),
                        ([(u1, (4091,), False, (1 << 64) - 5)], np.zeros(8, np.uint8))):
        ep = await connect("127.0.0.1", victim.port, timeout=30)
        futs = await _raw_batch(ep, _batch_header(specs), [data])
        ev = await victim.event()
        assert ev["error"] == "ProtocolError", ev
        for f in futs:
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        await ep.close()
    report("W1: batches of other sizes than announced", before, await victim.stats())
    await victim.stop()


# ------------------------------------------------------------------------- S9
async def test_s9_a_flood_nobody_receives_is_freed_when_the_client_leaves(victims):
    victim = await victims("idle")
    msg = np.ones(4096, np.uint8)

    async def flood() -> None:
        ep = await connect("127.0.0.1", victim.port, timeout=30)
        tag = (ep._send_ns << 32) | 7  # a tag the handler never receives
        futs = [ep.isend(msg, tag) for _ in range(40_000)]  # ~160 MB
        pending = [f for f in futs if f is not None]
        if pending:
            await asyncio.wait_for(asyncio.gather(*pending), 120)
        await ep.close()
        assert (await victim.event())["error"] == "PeerFailure"

    base = await victim.stats()
    await flood()
    first = await victim.settle("unreceived", 0)  # (drained after the grace period)
    assert first["unreceived"] == 0, first
    await flood()
    second = await victim.settle("unreceived", 0)
    assert second["unreceived"] == 0, second
    # The first flood's memory is back in UCX's pools and serves the second one: the
    # victim does not grow again (without the drain it kept all ~160 MB each time).
    report("S9: first flood of ~160 MB, client left", base, first)
    report("S9: second flood, client left", first, second)
    assert second["rss"] - first["rss"] < 48 * MiB, (base, first, second)
    await victim.stop()


# ------------------------------------------------------------------- S10, S11
async def test_s10_raw_garbage_leaks_no_descriptor(victims):
    victim = await victims("obj")
    before = await victim.stats()
    base = before["fds"]
    for _ in range(50):
        reader, writer = await asyncio.open_connection("127.0.0.1", victim.port)
        writer.write(os.urandom(8192))
        try:  # the listener hangs up at once (EOF, or a reset: data left unread)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(1 << 20), 10) == b""
        except ConnectionResetError:
            pass
        writer.close()
    st = await victim.settle("fds", base)
    report("S10: 50 connections of 8 KiB garbage", before, st)
    assert st["fds"] <= base, (base, st)
    await legit_object_round(victim)
    err = await victim.stop()
    assert "Traceback" not in err and "accept() failed" not in err, err[-2000:]


async def test_s11_silent_connections_are_dropped_quietly(victims):
    victim = await victims("obj", "--timeout", "5")
    before = await victim.stats()
    base = before["fds"]
    half = [await _raw_open_only(victim.port) for _ in range(5)]  # opened, then silent
    silent = [await asyncio.open_connection("127.0.0.1", victim.port) for _ in range(100)]

    async def closed_soon(reader) -> bool:
        try:
            return await asyncio.wait_for(reader.read(1), 2.5) == b""
        except TimeoutError:
            return False

    # Past MAX_PENDING (64: 5 + 59 of these) they are closed at once; the rest after
    # the listener's 5 s handshake timeout.
    early = await asyncio.gather(*(closed_soon(r) for r, _ in silent))
    assert sum(early) >= 100 - 59, sum(early)
    st = await victim.settle("fds", base, timeout=15)
    report("S11: 105 silent connections", before, st)
    assert st["fds"] <= base, (base, st)
    for r, w in silent + half:
        assert await asyncio.wait_for(r.read(1 << 16), 10) == b""  # closed on them all
        w.close()
    await legit_object_round(victim)
    err = await victim.stop()
    assert "Traceback" not in err and "ERROR" not in err, err[-2000:]


async def _raw_open_only(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_OPEN.pack(_MAGIC, _VERSION, 0, os.urandom(32)))
    await reader.readexactly(_ANSWER.size)
    return reader, writer


# ----------------------------------------------------------------------- W2, U1
async def test_w2_signals_of_another_size_are_refused(victims):
    victim = await victims("signal")
    before = await victim.stats()
    for payload in (bytes(MiB), b"\x01\x02"):
        ep = await connect("127.0.0.1", victim.port, timeout=30)
        await ep.recv_remote_memory()
        await send_raw(ep, payload, _SIGNAL_TAG)
        ev = await victim.event()
        assert ev["error"] == "ProtocolError" and "signal" in ev["msg"], ev
        await ep.close()
    # A real put_signal is delivered as sent.
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    remote = await ep.recv_remote_memory()
    await ep.put_signal(remote, np.full(64, 5, np.uint8), offset=128, value=-3)
    assert (await victim.event())["signal"] == [128, 64, -3]
    await ep.close()
    report("W2: signals of other sizes", before, await victim.stats())
    await victim.stop()


async def test_u1_a_short_region_message_is_a_clear_error(victims):
    victim = await victims("region")
    before = await victim.stats()
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    await send_raw(ep, b"\x01\x02", _REGION_TAG)
    ev = await victim.event()
    assert ev["error"] == "ProtocolError" and "2 bytes" in ev["msg"], ev
    await ep.close()
    report("U1: a 2-byte region message", before, await victim.stats())
    await victim.stop()


# ----------------------------------------------------------------- U2, binding
async def test_u2_busy_port_is_named_and_a_port_is_reusable_at_once():
    async def handler(ep):
        await ep.send_obj("hi")
        await ep.close()

    lst = await listen(handler)
    port = lst.port
    with pytest.raises(UcxCommError, match=f"port {port} is in use"):
        await listen(handler, port)
    ep = await connect("127.0.0.1", port, timeout=30)
    assert await ep.recv_obj() == "hi"
    await ep.close()
    await lst.close()
    async with await listen(handler, port) as again:  # no 60 s wait
        ep = await connect("127.0.0.1", again.port, timeout=30)
        assert await ep.recv_obj() == "hi"
        await ep.close()


async def test_listening_beyond_loopback_needs_a_token_or_insecure():
    async def handler(ep):
        await ep.close()

    for host in ("0.0.0.0", "::", socket.gethostname()):
        with pytest.raises(ValueError, match=r"token=.*insecure=True"):
            await listen(handler, 0, host=host)
    async with await listen(handler, 0, host="0.0.0.0", token="t0ken") as lst:
        assert lst.ip == "0.0.0.0"
        with pytest.raises(AuthenticationError):
            await connect("127.0.0.1", lst.port, timeout=30)
        ep = await connect("127.0.0.1", lst.port, token="t0ken", timeout=30)
        await ep.close()
    async with await listen(handler, 0, host="0.0.0.0", insecure=True) as lst:
        ep = await connect("127.0.0.1", lst.port, timeout=30)
        assert not ep.authenticated
        await ep.close()
    async with await listen(handler, 0, host="::1") as lst:  # loopback: no token needed
        assert lst.ip == "::1"
    for bad in (b"", "", 5):
        with pytest.raises(ValueError, match="token"):
            await listen(handler, 0, token=bad)


async def test_a_client_with_a_token_refuses_a_listener_without_one():
    async def handler(ep):  # pragma: no cover - never reached
        raise AssertionError("handler called")

    async with await listen(handler) as lst:
        with pytest.raises(AuthenticationError, match="has no token"):
            await connect("127.0.0.1", lst.port, token="mine", timeout=30)


async def test_the_bind_address_is_honoured():
    async def handler(ep):  # pragma: no cover - never reached
        await ep.close()

    # The same port on 127.0.0.1 is held bound and not listening, so a connection there
    # is refused for sure (a process of another test listening on that port by chance
    # accepted the TCP connection once, and the connect timed out instead).
    for _ in range(20):
        async with await listen(handler, 0, host="127.0.0.2") as lst:
            assert lst.ip == "127.0.0.2"
            guard = socket.socket()
            try:
                guard.bind(("127.0.0.1", lst.port))
            except OSError:
                guard.close()
                continue  # (taken on 127.0.0.1: another port)
            with guard, pytest.raises(ucxcomm.PeerFailure, match="refused"):
                await connect("127.0.0.1", lst.port, timeout=10)
            return
    pytest.fail("no port was free on both 127.0.0.1 and 127.0.0.2")


# ------------------------------------------------------------------ safe codec
def test_safe_codec_refuses_callables_and_round_trips_plain_data():
    from ucxcomm._serialize import decode_header, encode, loads

    for bad in (lambda: 1, os.system, Evil("x"), np, type, object(),
                np.array([object()]), collections.OrderedDict()):
        with pytest.raises(TypeError, match="safe codec"):
            encode(bad, 0, "safe")
    value = {"i": -(1 << 70), "f": 1.5, "c": 2j, "s": "é", "b": b"\x00", "ba": bytearray(b"z"),
             "l": [None, True, False], "t": (1, (2,)), "set": {1, 2}, "fs": frozenset("ab"),
             3: "int key", "a": np.arange(12.0).reshape(3, 4),
             "af": np.asfortranarray(np.ones((3, 2), np.int16)),
             "big": np.arange(10_000, dtype=np.uint32), "dt": np.dtype("<M8[ns]"),
             "sc": np.float32(2.5), "rec": np.zeros(3, dtype=[("x", "<f4"), ("y", "<i8")])}
    message, frames = encode(value, 7, "safe")
    assert frames, "large arrays travel as frames"
    header = decode_header(message)
    assert header.codec == "safe" and header.seq == 7
    got = loads(header, [bytearray(bytes(f)) for f in frames])
    assert got.keys() == value.keys()
    for k, v in value.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and (got[k] == v).all()
            assert got[k].flags.f_contiguous == v.flags.f_contiguous
        else:
            assert got[k] == v and type(got[k]) is type(v), k


# ------------------------------------------------ review of the fix (issue 27)
async def test_announced_batches_of_a_departed_writer_are_released(victims):
    """A writer announces batches within its credits (4 x 1 GiB), sends no data and
    leaves: the reader had posted receives into buffers for them; a receive UCX
    withdraws at once now releases its buffer (the abandoned receives kept them for the
    life of the worker: +4 GiB of address space per client, for good)."""
    victim = await victims("stream")
    before = await victim.stats()
    header = _batch_header([(np.dtype(np.uint8), (1 << 30,), False, 1 << 30)])
    for _ in range(5):
        ep = await connect("127.0.0.1", victim.port, timeout=30)
        for _ in range(4):
            await asyncio.gather(*await _raw_batch(ep, header))
        await ep.close()
        assert (await victim.event())["error"] == "PeerFailure"
    after = await victim.settle("vm", before["vm"] + 1024 * MiB)
    report("review: 5 writers announced 4 GiB each and left", before, after)
    assert after["vm"] - before["vm"] < 1024 * MiB, (before, after)
    await victim.stop()


async def test_a_flood_into_another_namespace_is_dropped_too(victims):
    """UCX matches tags across the worker: a client can address a namespace that is not
    its connection's (one that never existed, here). Nobody will ever receive those: the
    worker's sweep drops them (the drain at close only covered the client's own)."""
    victim = await victims("idle")
    before = await victim.stats()
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    msg = np.ones(4096, np.uint8)
    tag = ((ep._send_ns ^ 0x5A5A5A) << 32) | 7
    futs = [f for f in (ep.isend(msg, tag) for _ in range(20_000)) if f is not None]
    if futs:
        await asyncio.wait_for(asyncio.gather(*futs), 120)
    assert (await victim.stats())["unreceived"] == 1
    await ep.close()
    assert (await victim.event())["error"] == "PeerFailure"
    after = await victim.settle("unreceived", 0)
    report("review: ~80 MB into a foreign namespace", before, after)
    assert after["unreceived"] == 0, after
    await victim.stop()


async def test_a_handler_that_never_closes_leaks_nothing(victims):
    """docs/api.md's shortest handler returns without closing its endpoint: once the
    client leaves, the endpoint, its descriptor and its UCX endpoint go anyway."""
    victim = await victims("noclose")
    before = await victim.stats()
    for _ in range(30):
        ep = await connect("127.0.0.1", victim.port, timeout=30)
        await ep.send_obj("hi")
        assert (await victim.event())["kind"] == "obj"
        await ep.close()
    after = await victim.settle("endpoints", 0)
    after = await victim.settle("fds", before["fds"])
    report("review: 30 clients of a handler that never closes", before, after)
    assert after["endpoints"] == 0 and after["fds"] <= before["fds"], (before, after)
    err = await victim.stop()
    assert "Traceback" not in err, err[-2000:]


async def test_wrong_tokens_are_logged_even_among_other_refusals(victims):
    """One rate limit per kind: other refusals (garbage) must not use up the warning
    that a wrong token gets."""
    victim = await victims("obj", "--token", "s3cret")
    for _ in range(3):
        _, writer = await asyncio.open_connection("127.0.0.1", victim.port)
        writer.write(os.urandom(64))
        writer.close()
        with pytest.raises(AuthenticationError):
            await connect("127.0.0.1", victim.port, token="wrong", timeout=30)
    err = await victim.stop()
    assert "refused a client" in err, err[-2000:]


async def test_a_loopback_listener_exposes_no_ucx_port_beyond_loopback(victims):
    victim = await victims("obj")
    ep = await connect("127.0.0.1", victim.port, timeout=30)  # (its worker is up)
    st = await victim.stats()
    assert st["tcp_listening"], st
    assert all(ip.startswith("127.") or ip == "::1" for ip in st["tcp_listening"]), st
    await ep.close()
    await victim.stop()


async def test_an_object_header_with_an_out_of_range_frame_sequence_is_refused(victims):
    """The frame sequence number picks the frames' tag: one past the object tags' range
    would have received frames on the signal tag, or in another namespace."""
    victim = await victims("obj")
    ep = await connect("127.0.0.1", victim.port, timeout=30)
    await send_raw(ep, struct.pack("<BIIQ", 3, 1, (1 << 30) - 1, 8) + b"N", _OBJ_TAG)
    ev = await victim.event()
    assert ev["error"] == "ProtocolError" and "sequence" in ev["msg"], ev
    await ep.close()
    await victim.stop()


async def test_another_process_presenting_the_listeners_own_address_is_refused(victims):
    """A client that learned the listener's worker address (any no-token client can)
    and presents it as its own would make the listener send to itself, into whatever
    namespace the client names."""
    victim = await victims("obj")
    own = bytes.fromhex((await victim.stats())["address"])
    assert await _raw_client(victim.port, own) == b""  # dropped
    await legit_object_round(victim)
    await victim.stop()


def test_safe_codec_keys_cannot_collide_in_bulk():
    """Dict keys and set members that hash alike in bulk (floats, complex numbers, big
    integers, tuples) are refused on both sides: 20,000 colliding complex keys took a
    decoder seconds, quadratically."""
    from ucxcomm._serialize import Header, decode_header, encode, loads

    for bad in ({1.5: 1}, {2j: 1}, {1 << 70: 1}, {(1, 2): 1}, {frozenset(): 1}, {1.5},
                frozenset({1 << 64})):
        with pytest.raises(TypeError, match="keys are str, bytes"):
            encode(bad, 0, "safe")
    # the same from a peer that does not check: refused before any hashing of note
    body = b"S" + struct.pack("<I", 3) + b"".join(b"c" + struct.pack("<dd", 1e6 * k, -k)
                                                  for k in range(3))
    with pytest.raises(ValueError, match="set member of type complex"):
        loads(Header(memoryview(body), 0, (), "safe"))
    ok = {"a": 1, b"b": 2, None: 3, True: 4, -(1 << 63): 5}
    assert loads(decode_header(encode(ok, 0, "safe")[0])) == ok

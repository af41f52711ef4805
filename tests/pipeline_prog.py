"""Programs for tests/test_pipeline.py, one process each (``python pipeline_prog.py MODE
...``). Each prints ``READY`` lines, results as ``RESULT {json}``, and ``DONE MODE``."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time

import numpy as np

from ucxcomm.transport import connect, listen


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def fill(buf: np.ndarray, client: int, k: int) -> None:
    """The content of batch ``k`` of ``client`` (checked by the server)."""
    buf[:] = (client << 32) | k


async def produce(port: int, client: int, count: int, nbytes: int, delay: float) -> None:
    """Connect and stream ``count`` batches of ``nbytes`` (uint64 words), each filled by
    :func:`fill`; wait for the server's verdict. ``delay`` > 0: sleep that long between
    batches (a slow producer the test kills mid-stream)."""
    ep = await connect("127.0.0.1", port, timeout=30)
    buf = np.empty(nbytes // 8, np.uint64)
    async with ep.stream_writer() as tx:
        for k in range(count):
            fill(buf, client, k)
            await tx.send(buf, meta=(client, k))
            if k == 0:
                print("STREAMING", flush=True)
            if delay:
                await asyncio.sleep(delay)
    verdict = await asyncio.wait_for(ep.recv_obj(), 120)
    print("RESULT", json.dumps(verdict), flush=True)
    await ep.close()


async def backpressure_producer(port: int, count: int, nbytes: int, pieces: int) -> None:
    """Send ``count`` batches of ``pieces`` arrays of ``nbytes`` in all, as fast as the
    stream lets us; report the time each send returned and the RSS along the way."""
    ep = await connect("127.0.0.1", port, timeout=30)
    buf = [np.ones(nbytes // pieces, np.uint8) for _ in range(pieces)]
    sent, rss = [], [rss_kib()]  # connected, nothing sent yet
    async with ep.stream_writer() as tx:
        for k in range(count):
            await tx.send(buf, meta=k)
            sent.append(time.monotonic())
            if k % 50 == 0:
                rss.append(rss_kib())
    rss.append(rss_kib())
    assert await asyncio.wait_for(ep.recv_obj(), 60) == "done"
    print("RESULT", json.dumps({"sent": sent, "rss": rss}), flush=True)
    await ep.close()


async def backpressure_consumer(count: int, window: int, work_s: float) -> None:
    """Listen; consume ``count`` batches, working ``work_s`` per batch (the sleep is the
    simulated work); report when each batch was released and the RSS along the way."""
    done = asyncio.get_running_loop().create_future()

    async def handler(ep):
        released, rss = [], [rss_kib()]  # connected, nothing received yet
        async with ep.stream_reader(window=window) as rx:
            async for batch in rx:
                with batch:
                    assert batch.meta == batch.seq and batch[0].nbytes > 0
                    await asyncio.sleep(work_s)  # the consumer's work
                    released.append(time.monotonic())  # (just before the release)
                if batch.seq % 50 == 0:
                    rss.append(rss_kib())
        rss.append(rss_kib())
        await ep.send_obj("done")
        done.set_result({"released": released, "rss": rss})

    async with await listen(handler) as lst:
        print("PORT", lst.port, flush=True)
        result = await asyncio.wait_for(done, 240)
    assert len(result["released"]) == count
    print("RESULT", json.dumps(result), flush=True)


async def signal_writer(port: int, rounds: int, slots: int, slot_bytes: int) -> None:
    """Connect, receive the server's region key, then ``rounds`` put-with-signal rounds
    on a ring of ``slots`` slots (round ``r`` reuses its slot once the server acked round
    ``r - slots``)."""
    ep = await connect("127.0.0.1", port, timeout=30)
    remote = await ep.recv_remote_memory()
    buf = np.empty(slot_bytes // 4, np.uint32)
    ack = bytearray(8)
    for r in range(rounds):
        if r >= slots:
            await ep.recv(ack, tag=1)
            assert int.from_bytes(ack, "little") == r - slots
        buf[:] = r
        await ep.put_signal(remote, buf, (r % slots) * slot_bytes, value=r)
    for _ in range(min(slots, rounds)):
        await ep.recv(ack, tag=1)
    remote.close()
    print("RESULT", json.dumps({"rounds": rounds}), flush=True)
    await ep.close()


async def serve() -> None:
    """Listen; on each connection, read a stream (checking :func:`fill`'s content) and
    send the verdict ``[batches, []]``, and echo 1 MiB messages on tag 1 (what
    :func:`echo_client` sends), whichever the client does; print ``SERVED client n`` or
    ``FAILED client`` (its peer died; ``client`` is ``None`` for an echo client) per
    connection. Ends when a line arrives on stdin."""
    from ucxcomm import PeerFailure

    async def stream(ep, seen: dict) -> None:
        async with ep.stream_reader(window=4) as rx:
            n = 0
            async for batch in rx:
                with batch:
                    seen["client"], k = batch.meta
                    assert k == n and (batch[0] == ((seen["client"] << 32) | k)).all()
                    n += 1
        await ep.send_obj([n, []])
        print("SERVED", seen["client"], n, flush=True)

    async def echo(ep) -> None:
        buf = bytearray(1 << 20)
        while True:
            await ep.recv(buf, tag=1)
            await ep.send(buf, tag=1)

    async def handler(ep):
        seen: dict = {"client": None}
        tasks = [asyncio.ensure_future(stream(ep, seen)), asyncio.ensure_future(echo(ep))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
        except PeerFailure:
            print("FAILED", seen["client"], flush=True)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await ep.close()

    loop = asyncio.get_running_loop()
    async with await listen(handler) as lst:
        print("PORT", lst.port, flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)


async def echo_client(port: int) -> None:
    """Connect and exchange 1 MiB messages with :func:`serve` until killed."""
    ep = await connect("127.0.0.1", port, timeout=30)
    buf = bytearray(1 << 20)
    for k in itertools.count():
        await ep.send(buf, tag=1)
        await ep.recv(buf, tag=1)
        if k == 3:
            print("STREAMING", flush=True)


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "produce":
        port, client, count, nbytes = map(int, args[:4])
        coro = produce(port, client, count, nbytes, float(args[4]) if len(args) > 4 else 0)
    elif mode == "bp-producer":
        coro = backpressure_producer(*map(int, args))
    elif mode == "bp-consumer":
        coro = backpressure_consumer(int(args[0]), int(args[1]), float(args[2]))
    elif mode == "serve":
        coro = serve()
    elif mode == "echo-client":
        coro = echo_client(int(args[0]))
    elif mode == "signal-writer":
        coro = signal_writer(*map(int, args))
    else:
        raise SystemExit(f"unknown mode {mode}")
    asyncio.run(coro)
    print("DONE", mode, flush=True)


if __name__ == "__main__":
    main()

"""Baselines of benchmarks/pipeline.py: the same producer -> consumer stream written on
raw ucxx (``ucxx.create_listener``/``create_endpoint``, ``await ep.send``/``recv`` into
a reused buffer, in a chosen progress mode) and on asyncio TCP streams
(``writer.write`` + ``drain``, ``reader.readexactly``).

    python pipeline_peers.py consumer IMPL SCHEDULE        # prints PORT n
    python pipeline_peers.py producer IMPL SCHEDULE PORT   # prints BENCH lines

IMPL is ``ucxx-polling``, ``ucxx-blocking``, ``ucxx-thread`` or ``asyncio``; SCHEDULE is
``size:count:reps,...`` (see benchmarks/pipeline.py). After each rep's ``count``
messages the consumer answers one byte; the producer times send-first to answer.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import numpy as np


def parse(schedule: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in item.split(":")) for item in schedule.split(",")]  # type: ignore[misc]


def emit(impl: str, size: int, samples: list[float]) -> None:
    import json

    rec = {"impl": impl, "op": "stream_GBps", "size": size, "nranks": 2,
           "median": statistics.median(samples), "min": min(samples), "max": max(samples)}
    print("BENCH " + json.dumps(rec), flush=True)


# ------------------------------------------------------------------------ ucxx
async def ucxx_consumer(mode: str, schedule: list[tuple[int, int, int]]) -> None:
    import ucxx

    ucxx.init(progress_mode=mode)
    done = asyncio.get_running_loop().create_future()

    async def handler(ep) -> None:
        ack = np.ones(1, np.uint8)
        for size, count, reps in schedule:
            buf = np.empty(size, np.uint8)
            for _ in range(reps):
                for _ in range(count):
                    await ep.recv(buf)
                await ep.send(ack)
        await ep.recv(ack)  # the producer's goodbye: our last answer arrived
        done.set_result(None)

    lf = ucxx.create_listener(handler)
    print("PORT", lf.port, flush=True)
    await done
    for _ in range(3):  # let the handler return and ucxx retire it (else it warns)
        await asyncio.sleep(0)
    lf.close()


async def ucxx_producer(mode: str, schedule: list[tuple[int, int, int]], port: int) -> None:
    import ucxx

    ucxx.init(progress_mode=mode)
    ep = await ucxx.create_endpoint("127.0.0.1", port)
    ack = np.empty(1, np.uint8)
    for size, count, reps in schedule:
        buf = np.ones(size, np.uint8)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(count):
                await ep.send(buf)
            await ep.recv(ack)
            samples.append(size * count / (time.perf_counter() - t0) / 1e9)
        emit(f"ucxx-{mode}", size, samples)
    await ep.send(ack)
    await ep.close()


# --------------------------------------------------------------------- asyncio
async def asyncio_consumer(schedule: list[tuple[int, int, int]]) -> None:
    done = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for size, count, reps in schedule:
            for _ in range(reps):
                for _ in range(count):
                    await reader.readexactly(size)
                writer.write(b"k")
                await writer.drain()
        writer.close()
        done.set_result(None)

    server = await asyncio.start_server(handler, "127.0.0.1", 0, limit=1 << 26)
    print("PORT", server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await done


async def asyncio_producer(schedule: list[tuple[int, int, int]], port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for size, count, reps in schedule:
        data = bytes(size)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(count):
                writer.write(data)
                await writer.drain()
            await reader.readexactly(1)
            samples.append(size * count / (time.perf_counter() - t0) / 1e9)
        emit("asyncio", size, samples)
    writer.close()


def main() -> None:
    role, impl, schedule = sys.argv[1], sys.argv[2], parse(sys.argv[3])
    if impl == "asyncio":
        coro = asyncio_consumer(schedule) if role == "consumer" else \
            asyncio_producer(schedule, int(sys.argv[4]))
    elif impl.startswith("ucxx-"):
        mode = impl[5:]
        coro = ucxx_consumer(mode, schedule) if role == "consumer" else \
            ucxx_producer(mode, schedule, int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown implementation {impl}")
    asyncio.run(coro)


if __name__ == "__main__":
    main()

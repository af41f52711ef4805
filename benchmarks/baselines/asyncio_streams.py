"""Baseline: plain asyncio TCP streams on loopback (bandwidth and latency, one process
per side). Run: python asyncio_streams.py  (it forks the server itself)."""

import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _osu import BW_SIZES, LAT_SIZES, bw_reps, emit, lat_iters


async def serve(port_w: int) -> None:
    async def handler(reader, writer):
        try:
            while True:
                hdr = await reader.readexactly(9)
                n, echo = int.from_bytes(hdr[:8], "little"), hdr[8]
                data = await reader.readexactly(n)
                writer.write(data if echo else b"k")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    os.write(port_w, str(server.sockets[0].getsockname()[1]).encode().ljust(8))
    async with server:
        await server.serve_forever()


async def client(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for size in LAT_SIZES:
        data = b"x" * size
        samples = []
        for _rep in range(3):
            n = lat_iters(size)
            t0 = time.perf_counter()
            for _ in range(n):
                writer.write(size.to_bytes(8, "little") + b"\x01" + data)
                await reader.readexactly(size)
            samples.append((time.perf_counter() - t0) / n / 2 * 1e6)
        emit("asyncio-streams", "latency_us", size, samples)
    for size in BW_SIZES:
        data = b"x" * size
        samples = []
        for _rep in range(bw_reps(size)):
            w = 64 if size <= (1 << 20) else 4
            t0 = time.perf_counter()
            for _ in range(w):
                writer.write(size.to_bytes(8, "little") + b"\x00" + data)
                await writer.drain()
            for _ in range(w):
                await reader.readexactly(1)
            samples.append(size * w / (time.perf_counter() - t0) / 1e9)
        emit("asyncio-streams", "bandwidth_GBps", size, samples)
    writer.close()


def main() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        asyncio.run(serve(w))
        os._exit(0)
    os.close(w)
    port = int(os.read(r, 8).decode().strip())
    try:
        asyncio.run(client(port))
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()

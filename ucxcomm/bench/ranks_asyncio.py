"""asyncio streams' side of ``ucxcomm bench``: the same messages over a loopback TCP
connection between two processes (this one forks the echo side), as a service written
with plain asyncio would move them. Latency (ping-pong) and bandwidth (a window of
writes, then one acknowledgement per window, as the other implementations)."""

from __future__ import annotations

import asyncio
import os
import sys
import time

from .spec import emit, job_options

IMPL = "asyncio"


async def _serve(port_w: int) -> None:
    async def handler(reader, writer) -> None:
        try:
            while True:
                hdr = await reader.readexactly(9)
                n, reply = int.from_bytes(hdr[:8], "little"), hdr[8]
                data = await reader.readexactly(n)
                if reply == 1:  # ping: echo
                    writer.write(data)
                elif reply == 2:  # last of a window: one acknowledgement
                    writer.write(b"k")
                else:
                    continue
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    os.write(port_w, str(server.sockets[0].getsockname()[1]).encode().ljust(8))
    async with server:
        await server.serve_forever()


async def _client(port: int, ops: list[str], size: int, plan) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = b"x" * size
    ping = size.to_bytes(8, "little") + b"\x01" + data
    push = size.to_bytes(8, "little") + b"\x00" + data
    last = size.to_bytes(8, "little") + b"\x02" + data
    w = plan.window(size)
    windows = max(1, plan.iters(size) // w)  # as many as the others time per sample
    for op in ops:
        if op not in ("latency", "bw"):
            continue
        samples = []
        for rep in range(plan.samples + 1):
            if op == "latency":
                n = plan.iters(size)
                t0 = time.perf_counter()
                for _ in range(n):
                    writer.write(ping)
                    await reader.readexactly(size)
                value = (time.perf_counter() - t0) / n / 2 * 1e6
            else:  # a window of messages, then one acknowledgement, as OSU's bw
                t0 = time.perf_counter()
                for _ in range(windows):
                    for i in range(w):
                        writer.write(last if i == w - 1 else push)
                        await writer.drain()
                    await reader.readexactly(1)
                value = size * w * windows / (time.perf_counter() - t0) / 1e9
            if rep:
                samples.append(value)
        emit(IMPL, op, size, 2, samples)
    writer.close()


def main(argv: list[str]) -> None:
    args = job_options(argv[1:])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        asyncio.run(_serve(w))
        os._exit(0)
    os.close(w)
    port = int(os.read(r, 8).decode().strip())
    try:
        asyncio.run(_client(port, args.ops, args.size, args.plan))
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Connection set-up time of rank-less endpoints (``ucxcomm.transport.connect``), with
and without a token, against a listener in another process.

    python benchmarks/connect.py [--count 200] [--json out.jsonl]

Each sample is one ``connect`` (TCP connection, handshake, worker-address checks, UCX
endpoint and its wire-up check) plus one 1-byte round trip on the new connection (so the
path is really usable) and ``close``; the listener answers every connection the same way.
Prints median and 90th percentile per case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

TOKEN = "benchmark-token"


async def serve(token: str | None) -> None:
    import ucxcomm

    async def handler(ep: ucxcomm.pipes.Connection) -> None:
        buf = bytearray(1)
        try:
            await ep.recv(buf, tag=1)
            await ep.send(buf, tag=2)
            await ep.recv(buf, tag=3)  # until the client leaves
        except ucxcomm.PeerFailure:
            pass
        finally:
            await ep.close()

    lst = await ucxcomm.transport.listen(handler, 0, token=token, timeout=30)
    print(f"PORT {lst.port}", flush=True)
    await asyncio.get_running_loop().create_future()


async def measure(port: int, token: str | None, count: int) -> list[float]:
    import ucxcomm

    samples = []
    buf = bytearray(1)
    for i in range(count + 5):
        t0 = time.perf_counter()
        ep = await ucxcomm.transport.connect("127.0.0.1", port, token=token, timeout=30)
        await ep.send(b"x", tag=1)
        await ep.recv(buf, tag=2)
        dt = time.perf_counter() - t0
        await ep.close()
        if i >= 5:  # (warm-up: the first connections create the UCX worker)
            samples.append(dt)
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--json", default=None, help="append records to this JSON-lines file")
    p.add_argument("--serve", choices=["token", "none"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(TOKEN if args.serve == "token" else None))
        return
    records = []
    for case in ("none", "token"):
        server = subprocess.Popen([sys.executable, __file__, "--serve", case],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline().split()[1])
            samples = asyncio.run(measure(port, TOKEN if case == "token" else None,
                                          args.count))
        finally:
            server.kill()
            server.wait()
        samples.sort()
        rec = {"impl": "ucxcomm", "op": "connect", "token": case == "token",
               "count": len(samples), "median_ms": statistics.median(samples) * 1e3,
               "p90_ms": samples[int(0.9 * len(samples))] * 1e3}
        records.append(rec)
        print(f"connect + 1 B round trip + close, {'with' if rec['token'] else 'without'} "
              f"token: median {rec['median_ms']:.2f} ms, p90 {rec['p90_ms']:.2f} ms "
              f"({rec['count']} connections)", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()

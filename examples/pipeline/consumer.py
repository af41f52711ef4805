"""Pipeline consumer: connects to a producer, reduces every batch as it arrives and
prints the throughput (see docs/pipelines.md).

    python examples/pipeline/consumer.py --host 127.0.0.1 --port 13337 [--gpu]

``UCXCOMM_PIPELINE_TOKEN`` (the producer's secret, if it has one) authenticates both
sides. Whatever the producer sends is checked before use: batch metadata arrives in the
safe codec unless the connection is authenticated, so a rogue producer cannot make this
process run code (it gets a ``ProtocolError`` instead).

Received arrays live in a pool of reused buffers (host memory, or GPU memory with
``--gpu``); each batch is released as soon as it is reduced, which lets the producer send
the next one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import ucxcomm


async def main(args: argparse.Namespace) -> None:
    token = os.environ.get("UCXCOMM_PIPELINE_TOKEN") or None
    ep = await ucxcomm.transport.connect(args.host, args.port, token=token, timeout=30)
    print(f"connected over {ep.transport_info()}", flush=True)
    total, nbytes, count = 0.0, 0, 0
    t0 = time.perf_counter()
    async with ep.stream_reader(window=args.window, gpu=args.gpu) as batches:
        async for batch in batches:
            with batch:  # released (buffer back to the pool) at the end of the block
                arr = batch[0]
                s = float(arr.sum())  # the reduction (a cupy kernel with --gpu)
                if s != batch.meta["index"] * arr.size:
                    raise SystemExit(f"batch {batch.seq}: wrong content (sum {s})")
                total += s
                nbytes += arr.nbytes
                count += 1
    dt = time.perf_counter() - t0
    await ep.send_obj("thanks")
    await ep.close()
    print(f"{count} batches, {nbytes / 2**20:.0f} MiB in {dt:.2f} s: "
          f"{nbytes / dt / 1e9:.2f} GB/s; sum of all elements {total:.6g}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=13337)
    p.add_argument("--window", type=int, default=4, help="batches in flight at most")
    p.add_argument("--gpu", action="store_true", help="receive into GPU memory (cupy)")
    asyncio.run(main(p.parse_args()))

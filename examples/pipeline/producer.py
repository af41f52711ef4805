"""Pipeline producer: listens, and streams generated batches to every consumer that
connects (see docs/pipelines.md).

    UCXCOMM_PIPELINE_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')
    export UCXCOMM_PIPELINE_TOKEN   # the same in the consumer's environment
    python examples/pipeline/producer.py --port 13337 --batches 200 --mib 4 [--gpu]

With ``UCXCOMM_PIPELINE_TOKEN`` set, only consumers holding that secret get past the
handshake; without it the producer listens on loopback only (``--host`` beyond loopback
then refuses to start), and batch metadata travels in the safe codec (never pickled).

Each batch is one float32 array of ``--mib`` MiB whose every element is the batch's
number, so the consumer can check what it reduces. The stream's backpressure holds this
process back when a consumer is slower than it (its memory stays flat).
"""

from __future__ import annotations

import argparse
import asyncio
import os

import numpy as np

import ucxcomm


async def main(args: argparse.Namespace) -> None:
    xp = np
    if args.gpu:
        import cupy as xp  # type: ignore[no-redef]
    served = 0
    stop = asyncio.Event()

    async def serve(ep: ucxcomm.pipes.Connection) -> None:
        nonlocal served
        batch = xp.empty(args.mib * (1 << 20) // 4, dtype=xp.float32)
        try:
            async with ep.stream_writer() as tx:
                for i in range(args.batches):
                    batch.fill(i)  # "generate" the batch
                    await tx.send(batch, meta={"index": i})
            await ep.recv_obj()  # the consumer's goodbye: everything arrived
        except ucxcomm.PeerFailure as exc:
            print(f"a consumer went away: {exc}", flush=True)
        finally:
            await ep.close()
            served += 1
            if args.consumers and served >= args.consumers:
                stop.set()

    token = os.environ.get("UCXCOMM_PIPELINE_TOKEN") or None
    async with await ucxcomm.transport.listen(serve, args.port, host=args.host,
                                              token=token) as listener:
        print(f"producer listening on port {listener.port}", flush=True)
        await stop.wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=13337, help="0: any free port")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (beyond loopback: needs UCXCOMM_PIPELINE_TOKEN)")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--mib", type=int, default=4, help="MiB per batch")
    p.add_argument("--gpu", action="store_true", help="cupy arrays on the GPU")
    p.add_argument("--consumers", type=int, default=1,
                   help="exit after serving this many consumers (0: never)")
    asyncio.run(main(p.parse_args()))

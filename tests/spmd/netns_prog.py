"""A rank on one 'host' (network namespace): ring exchange over TCP, reports its lanes."""

import asyncio

import numpy as np

import ucxcomm


async def main() -> None:
    async with ucxcomm.init(timeout=60) as comm:
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        got = await comm.sendrecv(comm.rank, right, source=left, timeout=30)
        assert got == left
        big = np.full(4 << 20, comm.rank, np.uint8)
        out = np.empty_like(big)
        await comm.Sendrecv(big, right, out, left, timeout=60)
        assert (out == left).all()
        lanes = comm.transport_info()[right]
        print(f"NETNS-OK rank {comm.rank} lanes {lanes}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

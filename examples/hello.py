"""Quick-start demo: ranks exchange buffers and objects, then report transport, latency, bandwidth.

Run: ucxcomm run -n 2 examples/hello.py
"""

import asyncio
import time

import numpy as np

import ucxcomm


async def main() -> None:
    async with ucxcomm.init() as comm:
        rank, size = comm.rank, comm.size
        peer = (rank + 1) % size
        left = (rank - 1) % size
        # An object around the ring.
        got = await comm.sendrecv({"from": rank, "hello": "ucxcomm"}, dest=peer, source=left)
        assert got["from"] == left
        if size > 1 and rank < 2:
            other = 1 - rank
            lanes = comm.transport_info()[other]
            small = np.zeros(1, np.uint8)
            big = np.ones(16 << 20, np.uint8)
            iters = 2000
            await comm.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                if rank == 0:
                    await comm.Send(small, other)
                    await comm.Recv(small, other)
                else:
                    await comm.Recv(small, other)
                    await comm.Send(small, other)
            lat_us = (time.perf_counter() - t0) / iters / 2 * 1e6
            reps = 10
            await comm.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                if rank == 0:
                    await comm.Send(big, other)
                else:
                    await comm.Recv(big, other)
            await comm.barrier()
            gbs = big.nbytes * reps / (time.perf_counter() - t0) / 1e9
            if rank == 0:
                print(f"rank 0 <-> rank 1 over {', '.join(f'{t}/{d}' for t, d in lanes)}")
                print(f"  1-byte one-way latency: {lat_us:.1f} us")
                print(f"  16 MiB bandwidth:       {gbs:.2f} GB/s")
        else:
            await comm.barrier()
            await comm.barrier()
            await comm.barrier()
        print(f"rank {rank}/{size}: ok (got a hello from rank {got['from']})")


if __name__ == "__main__":
    asyncio.run(main())

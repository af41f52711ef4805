"""Forms the world from whatever launcher variables are set, exchanges around the ring."""

import asyncio

import ucxcomm


async def main() -> None:
    async with ucxcomm.init(timeout=60) as comm:
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        got = await comm.sendrecv(comm.rank, right, source=left, timeout=30)
        assert got == left, (got, left)
        print(f"WORLD-OK rank {comm.rank} size {comm.size}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

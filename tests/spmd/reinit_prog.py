"""Form the world, finalize, form it again (the launcher's store outlives each world)."""

import asyncio

import ucxcomm


async def one_world(round_: int) -> None:
    comm = await ucxcomm.init(timeout=60)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = await comm.sendrecv((round_, comm.rank), right, source=left, timeout=30)
    assert got == (round_, left), got
    await ucxcomm.finalize()
    assert comm.closed


async def main() -> None:
    for round_ in range(3):
        await one_world(round_)
    print(f"REINIT-OK rank {ucxcomm_rank()}", flush=True)


def ucxcomm_rank() -> int:
    import os

    return int(os.environ.get("UCXCOMM_RANK", "0"))


if __name__ == "__main__":
    asyncio.run(main())

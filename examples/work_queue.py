"""A distributed work queue on one-sided atomics: ranks grab task numbers with
``Win.Fetch_and_op`` on a counter at rank 0 until the tasks run out; no rank
coordinates the others, and rank 0 takes part like everyone else.

    ucxcomm run -n 3 python examples/work_queue.py
"""

import asyncio
import math

import numpy as np

import ucxcomm

TASKS = 200


def work(task: int) -> float:
    return math.fsum(math.sin(task * k) for k in range(2000))


async def main() -> None:
    async with ucxcomm.init() as comm:
        counter = await ucxcomm.Win.Allocate(comm, 8, disp_unit=8)
        done, total = [], 0.0
        while (task := await counter.Fetch_and_op(1, 0, 0, dtype=np.int64)) < TASKS:
            total += work(task)  # a busy rank 0 still serves the others' atomics
            done.append(task)
        await counter.Fence()
        everyone = await comm.gather(done)
        result = await comm.reduce(total, ucxcomm.SUM)
        if comm.rank == 0:
            flat = sorted(t for part in everyone for t in part)
            assert flat == list(range(TASKS)), "each task exactly once"
            print(f"{TASKS} tasks over {comm.size} ranks: " +
                  ", ".join(f"rank {r} did {len(p)}" for r, p in enumerate(everyone)) +
                  f"; checksum {result:.6f} (serial {math.fsum(map(work, range(TASKS))):.6f})")
        await counter.Free()


if __name__ == "__main__":
    asyncio.run(main())

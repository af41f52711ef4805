"""Senders far ahead of their receiver (tests/test_soak.py): every rank but 0 posts
``COUNT`` sends of mixed sizes to rank 0 at once, without waiting; rank 0 receives them
only afterwards (``ANY_SOURCE``), so that nearly all of them arrive unexpected and UCX
buffers what came eagerly (under 256 KiB on shared memory: docs/design.md, "Memory of
unexpected messages"). That is repeated ``CYCLES`` times; after each drain rank 0 prints
``UNEXPECTED cycle k rss_mib R objects O`` (RSS, and Python objects tracked by gc,
relative to the start). Memory held for consumed messages would grow with every cycle.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys

import numpy as np

import ucxcomm

SIZES = [0, 8, 200, 4096, 40_000, 200_000]
WEIGHTS = [0.2, 0.25, 0.2, 0.2, 0.1, 0.05]
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


async def main(count: int, cycles: int) -> None:
    comm = await ucxcomm.init()
    rng = np.random.default_rng(comm.rank)
    await comm.barrier()
    gc.collect()
    base_rss, base_objs = rss_mib(), len(gc.get_objects())
    for k in range(cycles):
        if comm.rank:
            sizes = rng.choice(SIZES, count, p=WEIGHTS)
            reqs = [comm.isend(bytes(int(n)), 0, tag=1) for n in sizes]
            await comm.barrier(timeout=120)  # all posted before rank 0 receives any
            await ucxcomm.Request.waitall(reqs)
        else:
            await comm.barrier(timeout=120)
            for _ in range((comm.size - 1) * count):
                await comm.recv(ucxcomm.ANY_SOURCE, tag=1, timeout=120)
            gc.collect()
            print(f"UNEXPECTED cycle {k} rss_mib {rss_mib() - base_rss:.1f} objects "
                  f"{len(gc.get_objects()) - base_objs}", flush=True)
        await comm.barrier(timeout=120)
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))

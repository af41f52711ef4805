"""One rank sending to itself, in one process (no second process, no scheduler between two
ranks: the least noise a 2-core machine allows): what ``recorder_cost.py`` and
``stats_cost.py`` time on each side of their comparisons. Prints two figures, ns per
iteration, each the best of 20 batches: 8 B ``Send`` + ``Recv`` (both finish in their
calls), and ``Irecv`` posted, 8 B ``Send``, ``await`` (a receive that waits)."""

from __future__ import annotations

import time


async def best(fn, n: int, batches: int = 20) -> float:
    """ns per call of the coroutine function ``fn``: best of ``batches`` batches of ``n``
    (after ``n // 10`` calls of warm-up)."""
    for _ in range(n // 10):
        await fn()
    out = float("inf")
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            await fn()
        out = min(out, (time.perf_counter() - t) / n)
    return out * 1e9


async def self_loops() -> None:
    import numpy as np

    import ucxcomm

    comm = await ucxcomm.init(rank=0, size=1)
    a, b = np.ones(1), np.empty(1)

    async def pair() -> None:
        await comm.Send(a, 0, 1)
        await comm.Recv(b, 0, 1)

    async def posted() -> None:
        r = comm.Irecv(b, 0, 1)
        await comm.Send(a, 0, 1)
        await r

    out = [await best(pair, 20000), await best(posted, 10000)]
    print(" ".join(f"{x:.0f}" for x in out))
    await ucxcomm.finalize()

"""A deliberately hung 3-rank job for ``ucxcomm status`` (tests/test_trace.py): rank 0
waits in a barrier, rank 1 in ``Recv(source=2, tag=7)``, rank 2 never sends: once the
flight recorders show the other two waiting, it prints ``READY <job directory>`` and
sleeps in user code (no ucxcomm call) until the job is stopped."""

from __future__ import annotations

import asyncio
import time

import numpy as np

import ucxcomm
from ucxcomm.comm import trace


async def main() -> None:
    comm = await ucxcomm.init()
    await comm.barrier()
    buf = np.zeros(4)
    if comm.rank == 0:
        await comm.barrier()
    elif comm.rank == 1:
        await comm.Recv(buf, source=2, tag=7)
    else:
        never_send()


def never_send() -> None:
    """Rank 2: wait (blocking, like user code that computes) until both others' records
    show them waiting (their only signal), say READY, then block until stopped."""
    path = trace.job_dir()
    deadline = time.monotonic() + 60
    while True:
        ranks = {r.rank: r for r in trace.load_job(path).ranks}
        if all(q in ranks and ranks[q].in_flight for q in (0, 1)):
            break
        if time.monotonic() > deadline:
            raise SystemExit("ranks 0 and 1 never showed as waiting")
        time.sleep(0.02)
    print(f"READY {path}", flush=True)
    time.sleep(600)  # (the test ends the job)

if __name__ == "__main__":
    asyncio.run(main())

"""Ranks busy in a loop when Ctrl-C reaches ``ucxcomm run`` (tests/test_interrupt.py).

``allreduce``: every rank runs Allreduce in a loop. ``recv_any``: rank 0 waits in
``recv(ANY_SOURCE)`` for a message nobody sends while the others run a send/recv ping
loop among themselves (or wait too, at 2 ranks). Each rank prints ``RUNNING r`` once its
loop is under way; on KeyboardInterrupt it prints one line, ``INTERRUPTED r``, and exits
130, so any other line on stderr (a traceback, a warning) is the library's noise.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

import ucxcomm


async def allreduce(comm) -> None:
    send = np.full(1024, comm.rank + 1, np.float64)
    recv = np.empty_like(send)
    want = comm.size * (comm.size + 1) / 2
    i = 0
    while True:
        await comm.Allreduce(send, recv)
        assert recv[0] == want
        i += 1
        if i == 20:
            print(f"RUNNING {comm.rank}", flush=True)


async def recv_any(comm) -> None:
    if comm.rank == 0 or comm.size < 3:
        print(f"RUNNING {comm.rank}", flush=True)
        await comm.recv(ucxcomm.ANY_SOURCE, tag=77)
        raise AssertionError("nobody sends tag 77")
    # Ranks 1 and 2 ping-pong (others beyond 2 wait like rank 0).
    if comm.rank > 2:
        print(f"RUNNING {comm.rank}", flush=True)
        await comm.recv(ucxcomm.ANY_SOURCE, tag=77)
    peer = 3 - comm.rank
    buf = np.zeros(64, np.uint8)
    i = 0
    while True:
        if comm.rank == 1:
            await comm.Send(buf, peer, tag=1)
            await comm.Recv(buf, peer, tag=1)
        else:
            await comm.Recv(buf, peer, tag=1)
            await comm.Send(buf, peer, tag=1)
        i += 1
        if i == 20:
            print(f"RUNNING {comm.rank}", flush=True)


async def main(mode: str) -> None:
    comm = await ucxcomm.init()
    await comm.barrier()
    await {"allreduce": allreduce, "recv_any": recv_any}[mode](comm)


if __name__ == "__main__":
    rank = "?"
    try:
        import os

        rank = os.environ.get("UCXCOMM_RANK", "?")
        asyncio.run(main(sys.argv[1]))
    except KeyboardInterrupt:
        print(f"INTERRUPTED {rank}", file=sys.stderr, flush=True)
        sys.exit(130)

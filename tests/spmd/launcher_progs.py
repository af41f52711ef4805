"""Rank programs for tests/test_launcher.py: each mode misbehaves in one specific way."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import ucxcomm


async def block_forever(comm) -> None:
    # A receive nobody will ever match: this rank only ends when the launcher ends it.
    await comm.recv(ucxcomm.ANY_SOURCE, tag=12345)


async def main(mode: str) -> None:
    comm = await ucxcomm.init()
    print(f"PID {comm.rank} {os.getpid()}", flush=True)
    await comm.barrier()
    if mode == "fail":  # rank 1 exits 3; the others would wait forever
        if comm.rank == 1:
            sys.exit(3)
        await block_forever(comm)
    elif mode == "signal":  # rank 0 dies by SIGKILL
        if comm.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        await block_forever(comm)
    elif mode == "early_exit":  # rank 1 exits 0 at once; rank 0 keeps working, then exits 0
        if comm.rank == 1:
            os._exit(0)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            sum(range(1000))
        print("still-here", flush=True)
        os._exit(0)
    elif mode == "hang":  # everyone blocks: only --timeout or a signal ends the job
        print(f"READY {comm.rank}", flush=True)
        await block_forever(comm)
    elif mode == "lines":  # lines written in pieces, both ranks at once
        ch = "AB"[comm.rank % 2]
        for _ in range(300):
            for piece in range(4):
                sys.stdout.write(ch * 1000 + ("\n" if piece == 3 else ""))
                sys.stdout.flush()
        await comm.close()
    elif mode == "no_close":  # ends without close(): a clean exit all the same
        await comm.barrier()
        print(f"OK {comm.rank}", flush=True)
    elif mode == "ok":
        print(f"OK {comm.rank}", flush=True)
        await comm.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))

"""A rank on one 'host' of ci/cluster-netns.sh (a network namespace on a bridge), started
torchrun-style (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

``work``: point-to-point, collectives and one-sided windows across the hosts over TCP,
checked; prints ``CLUSTER-OK r`` with the lanes to the next rank (and the window's). The
lanes must all be of the transports ``CLUSTER_LANES`` names, the first one among them
(default ``tcp``; the soft-RoCE VMs of ci/softroce/run say ``rc_verbs,ud_verbs``).
``cut``: an Allreduce + ring exchange loop; prints ``READY r`` once under way. The script
then cuts one host's link; every rank must leave the loop with ``PeerFailure`` (printing
``PEER-FAILURE r peer P after S s``, S since its last completed round) and exits 3.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

import ucxcomm


async def work(comm) -> None:
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    # point-to-point: objects, a large buffer, ANY_SOURCE
    assert await comm.sendrecv(("hi", r), right, source=left, timeout=30) == ("hi", left)
    big = np.full(4 << 20, r, np.uint8)
    out = np.empty_like(big)
    await comm.Sendrecv(big, right, out, left, timeout=60)
    assert (out == left).all()
    if r == 0:
        got = sorted([await comm.recv(ucxcomm.ANY_SOURCE, tag=7, timeout=30)
                      for _ in range(p - 1)])
        assert got == list(range(1, p)), got
    else:
        await comm.send(r, 0, tag=7)
    # collectives
    x = np.arange(1 << 16, dtype=np.float64) * (r + 1)
    y = np.empty_like(x)
    await comm.Allreduce(x, y)
    assert np.array_equal(y, np.arange(1 << 16, dtype=np.float64) * (p * (p + 1) // 2))
    assert await comm.bcast({"root": "data"} if r == 0 else None) == {"root": "data"}
    assert await comm.allgather(r) == list(range(p))
    sendbuf = np.full(p * 1000, r, np.int32)
    recvbuf = np.empty_like(sendbuf)
    await comm.Alltoall(sendbuf, recvbuf)
    assert (recvbuf.reshape(p, 1000) == np.arange(p)[:, None]).all()
    # one-sided: put/get with fences, an atomic counter, exclusive locks
    win = await ucxcomm.Win.Allocate(comm, 8 * p, disp_unit=8)
    await win.Fence()
    await win.Put(np.array([100 + r], np.int64), right, r)
    await win.Fence()
    mem = win.memory.view(np.int64)
    assert mem[left] == 100 + left, mem
    got = np.empty(1, np.int64)
    await win.Get(got, right, r)
    assert got[0] == 100 + r
    counter = await ucxcomm.Win.Allocate(comm, 8, disp_unit=8)
    olds = [await counter.Fetch_and_op(1, 0, 0) for _ in range(20)]
    assert olds == sorted(olds)
    await comm.barrier()
    if r == 0:
        assert counter.memory.view(np.int64)[0] == 20 * p
    await win.Lock(0)
    await win.Accumulate(np.array([1], np.int64), 0, p - 1)
    await win.Unlock(0)
    await comm.barrier()
    if r == 0:  # (rank p-1's Put, then one Accumulate of 1 per rank)
        assert mem[p - 1] == 100 + (p - 1) + p, mem
    want = os.environ.get("CLUSTER_LANES", "tcp").split(",")
    rma_lanes = win.transport_info()[right]
    await counter.Free()
    await win.Free()
    lanes = comm.transport_info()[right]
    for got in (lanes, rma_lanes):
        assert want[0] in [tl for tl, _ in got] and all(tl in want for tl, _ in got), got
    print(f"CLUSTER-OK {r} lanes {lanes} rma {rma_lanes}", flush=True)


async def cut(comm) -> None:
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    x = np.ones(1 << 14)
    y = np.empty_like(x)
    buf = np.empty(1 << 16, np.uint8)
    n, last = 0, time.monotonic()
    try:
        while True:
            await comm.Allreduce(x, y)
            await comm.Sendrecv(np.full(1 << 16, r, np.uint8), right, buf, left)
            n, last = n + 1, time.monotonic()
            if n == 20:
                print(f"READY {r}", flush=True)
            await asyncio.sleep(0.01)  # (a round every ~10 ms: the link is cut mid-round)
    except ucxcomm.PeerFailure as exc:
        print(f"PEER-FAILURE {r} peer {exc.peer} after {time.monotonic() - last:.1f} s",
              flush=True)
        comm.abort()
        sys.exit(3)


async def main(mode: str) -> None:
    comm = await ucxcomm.init(timeout=60)
    if mode == "work":
        await work(comm)
        await comm.close()
    else:
        await cut(comm)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))

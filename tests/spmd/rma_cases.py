"""SPMD one-sided cases (remote memory and windows). Run one:
``ucxcomm run -n 3 python tests/spmd/rma_cases.py NAME``; each rank prints
``CASE-OK NAME rank R`` when its assertions passed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

import ucxcomm
from ucxcomm.testing import Cases

cases = Cases()
case = cases.case


@case
async def remote_memory(comm):
    """Transport level: register, exchange keys, put/get/flush, atomics."""
    p, r = comm.size, comm.rank
    worker = ucxcomm.transport.default_worker()
    mem = np.zeros(1024, np.uint64)
    reg = worker.register(mem)
    infos = await comm.allgather((reg.rkey, reg.address, reg.nbytes))
    remote = [worker.remote_memory(*i) for i in infos]
    right, left = (r + 1) % p, (r - 1) % p
    await remote[right].put(np.full(4, 100 + r, np.uint64), 8)
    await remote[right].flush()
    await comm.barrier()
    assert (mem[1:5] == 100 + left).all(), mem[:6]
    got = np.zeros(4, np.uint64)
    await remote[left].get(got, 8)
    assert (got == 100 + (left - 1) % p).all(), got
    olds = [await remote[0].fetch_add(1, 512) for _ in range(100)]
    assert olds == sorted(olds)
    await remote[0].flush()
    allolds = await comm.allgather(olds)
    await comm.barrier()
    if r == 0:
        assert sorted(x for lst in allolds for x in lst) == list(range(100 * p))
        assert mem[64] == 100 * p
    # and / or / xor / swap on 32-bit words
    await remote[0].atomic("or", 1 << r, 1024, np.uint32, fetch=False)
    await remote[0].flush()
    await comm.barrier()
    if r == 0:
        assert mem.view(np.uint32)[256] == (1 << p) - 1
    try:
        await remote[right].put(np.zeros(2, np.uint64), 8 * 1023)
    except ucxcomm.WindowError:
        pass
    else:
        raise AssertionError("an out-of-range put was accepted")
    await comm.barrier()
    for rm in remote:
        rm.close()
    reg.close()


@case
async def shared_counter(comm):
    """A counter hammered by every rank with Fetch_and_op ends exact, every fetched value
    is unique; Compare_and_swap has exactly one winner."""
    p, r = comm.size, comm.rank
    win = await ucxcomm.Win.Allocate(comm, 64, disp_unit=8)
    n = 150
    got = [await win.Fetch_and_op(1, 0, 0) for _ in range(n)]
    await win.Fence()
    everyone = await comm.allgather(got)
    flat = sorted(x for lst in everyone for x in lst)
    assert flat == list(range(n * p)), flat[:10]
    if r == 0:
        assert win.memory.view(np.int64)[0] == n * p
    old = await win.Compare_and_swap(r + 1, 0, 0, 1)
    winners = await comm.allgather(old == 0)
    assert sum(winners) == 1, winners
    await win.Fence()
    final = np.zeros(1, np.int64)
    await win.Get(final, 0, 1)
    assert final[0] == winners.index(True) + 1
    # other ops: BXOR and REPLACE (native), NO_OP fetch
    await win.Fetch_and_op(1 << r, 0, 2, op=ucxcomm.BXOR)
    await win.Fence()
    assert await win.Fetch_and_op(0, 0, 2, op=ucxcomm.NO_OP) == (1 << p) - 1
    await win.Free()


@case
async def put_get_fence(comm):
    p, r = comm.size, comm.rank
    buf = np.zeros(4096, np.float64)
    win = await ucxcomm.Win.Create(comm, buf, disp_unit=8)
    right, left = (r + 1) % p, (r - 1) % p
    async with win.fence_epoch():
        await win.Put(np.arange(100, dtype=np.float64) + r, right, 10)
    assert (buf[10:110] == np.arange(100) + left).all()
    out = np.zeros(100)
    await win.Get(out, left, 10)
    assert (out == np.arange(100) + (left - 1) % p).all()
    big = np.arange(3000, dtype=np.float64) * (r + 1)
    await win.Put(big, right, 1000)
    await win.Flush(right)
    await win.Fence()
    assert (buf[1000:4000] == np.arange(3000) * (left + 1)).all()
    await win.Free()
    assert win.closed


@case
async def allocated_memory(comm):
    """Memory UCX allocated (``worker.allocate``, ``Win.Allocate``): peers on this host put
    and get it by copies and update it with CPU atomics; every size and origin kind lands
    exactly, next to the bytes it must not touch."""
    p, r = comm.size, comm.rank
    worker = ucxcomm.transport.default_worker()
    n = (1 << 20) + 64
    region = worker.allocate(n)
    assert region.memory.nbytes == n and not region.memory.any()
    infos = await comm.allgather((region.rkey, region.address, region.nbytes))
    remote = [worker.remote_memory(*i) for i in infos]
    right, left = (r + 1) % p, (r - 1) % p
    rng = np.random.default_rng(r)
    sizes = [1, 8, 4095, 65536 + 3, 1 << 20]
    sent = []
    for i, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        sent.append(data)
        origin = (data, bytearray(data.tobytes()), memoryview(data.tobytes()))[i % 3]
        await remote[right].put(origin, 32)
        back = np.zeros(size, np.uint8)
        await remote[right].get(back if i % 2 else memoryview(back), 32)
        assert (back == data).all(), (size, i)
    await remote[right].flush()
    await comm.barrier()
    mem = region.memory
    assert not mem[:32].any() and not mem[32 + (1 << 20):].any()
    assert (mem[32:32 + (1 << 20)] == sent_by(left, sizes)[-1]).all()
    await comm.barrier()
    olds = [await remote[0].fetch_add(1, 8) for _ in range(50)]
    assert olds == sorted(olds)
    await remote[0].flush()
    await comm.barrier()
    if r == 0:
        assert region.memory.view(np.uint64)[1] == 50 * p
    await comm.barrier()
    for rm in remote:
        rm.close()
    region.close()
    assert region.memory is None


def sent_by(rank, sizes):
    """The buffers :func:`allocated_memory` at ``rank`` put, in order."""
    rng = np.random.default_rng(rank)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


@case
async def lock_holder_dies(comm):
    """Regression (issue 15, defect 2): the last rank dies holding rank 0's exclusive
    lock; waiters spun forever. Now Lock, Lock_all, Flush and Fence raise PeerFailure
    once the death is declared (within the failure-detection delay), naming the rank."""
    victim = comm.size - 1
    win = await ucxcomm.Win.Allocate(comm, 64, disp_unit=8)
    if comm.rank == victim:
        await win.Lock(0)
        await comm.barrier()  # the others start waiting only once it holds the lock
        sys.stdout.write(f"CASE-OK lock_holder_dies rank {comm.rank}\n")
        sys.stdout.flush()
        os._exit(0)  # dies holding the lock, without closing
    await comm.barrier()
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(win.Lock(0), 30)
    except ucxcomm.PeerFailure as exc:
        assert exc.peer == victim and f"rank {victim}" in str(exc), exc
    else:
        raise AssertionError("took a lock its dead holder never released")
    assert time.monotonic() - t0 < 20
    for call in (win.Lock_all, lambda: win.Flush(victim), win.Fence):
        try:
            await asyncio.wait_for(call(), 30)
        except ucxcomm.PeerFailure:
            pass
        else:
            raise AssertionError(f"{call} succeeded with a dead rank")
    await win.Unlock_all()  # what Lock_all took before it failed
    comm.abort()
    return "aborted"


@case
async def close_without_free(comm):
    """Closing with windows never freed (and sends in flight) releases everything
    quietly: before, UCX printed a warning per remote key and per registration left
    behind ("not returned to mpool ucp_rkeys", "destroying inuse region")."""
    peer = (comm.rank + 1) % comm.size
    win = await ucxcomm.Win.Allocate(comm, 4096)
    win2 = await ucxcomm.Win.Create(comm, np.zeros(64))
    await win.Put(np.ones(8, np.uint8), peer)
    await win2.Fetch_and_op(1, peer, 0, dtype=np.int64)
    for _ in range(4):
        comm.Isend(np.ones(1 << 16, np.uint8), peer, 5)
    await comm.barrier()
    await comm.close()
    return "closed"


@case
async def accumulate(comm):
    """Concurrent accumulates from every rank sum exactly: float64 (locked get-op-put)
    and int64 (remote atomics); MAX and Get_accumulate."""
    p, r = comm.size, comm.rank
    win = await ucxcomm.Win.Allocate(comm, 8 * 64, disp_unit=8)
    for _ in range(10):
        await win.Accumulate(np.full(8, r + 0.5), 0, 0)
        await win.Accumulate(np.full(8, r + 1, np.int64), 0, 8)
        await win.Accumulate(np.array([r * 10.0]), 0, 20, op=ucxcomm.MAX)
    await win.Fence()
    if r == 0:
        mem = win.memory
        assert (mem.view(np.float64)[:8] == 10 * sum(q + 0.5 for q in range(p))).all()
        assert (mem.view(np.int64)[8:16] == 10 * sum(q + 1 for q in range(p))).all()
        assert mem.view(np.float64)[20] == (p - 1) * 10.0
    await win.Fence()
    res = np.zeros(2)
    await win.Get_accumulate(np.ones(2), res, 0, 30)
    await win.Fence()
    seen = await comm.allgather(res[0])
    assert sorted(seen) == [float(i) for i in range(p)], seen
    # integer Get_accumulate (remote atomics, all elements in flight): distinct olds
    olds = np.zeros(4, np.int64)
    await win.Get_accumulate(np.full(4, 1, np.int64), olds, 0, 40)
    await win.Fence()
    seen = await comm.allgather(olds.tolist())
    for i in range(4):
        assert sorted(s[i] for s in seen) == list(range(p)), seen
    try:
        await win.Accumulate(np.ones(2, np.float32), 0, 0, op=ucxcomm.BAND)
    except TypeError:
        pass
    else:
        raise AssertionError("BAND on floats was accepted")
    await win.Free()


@case
async def exclusive_locks(comm):
    """Non-atomic read-modify-write under an exclusive lock: the total is exact."""
    p, r = comm.size, comm.rank
    win = await ucxcomm.Win.Allocate(comm, 16, disp_unit=8)
    n = 25
    cur = np.zeros(1, np.int64)
    for _ in range(n):
        async with win.lock(0, exclusive=True):
            await win.Get(cur, 0, 0)
            cur += 1
            await win.Put(cur, 0, 0)
    await comm.barrier()  # every exclusive section is over
    await win.Lock(0, exclusive=False)  # shared readers hold it together
    await win.Get(cur, 0, 0)
    await comm.barrier()
    await win.Unlock(0)
    await win.Fence()
    final = await comm.bcast(int(win.memory.view(np.int64)[0]) if r == 0 else None)
    assert final == n * p, final
    await win.Lock_all()
    await win.Unlock_all()
    await win.Free()


@case
async def out_of_range(comm):
    """Bad access raises WindowError/ValueError before anything is written."""
    p, r = comm.size, comm.rank
    win = await ucxcomm.Win.Allocate(comm, 64, disp_unit=8)
    bad = [
        (lambda: win.Put(np.ones(2), (r + 1) % p, 7), ucxcomm.WindowError),
        (lambda: win.Put(np.ones(1), 0, -1), ucxcomm.WindowError),
        (lambda: win.Get(np.ones(9), 0, 0), ucxcomm.WindowError),
        (lambda: win.Accumulate(np.ones(9), 0, 0), ucxcomm.WindowError),
        (lambda: win.Fetch_and_op(1, 0, 8), ucxcomm.WindowError),
        (lambda: win.Compare_and_swap(1, 0, 0, 8), ucxcomm.WindowError),
        (lambda: win.Put(np.ones(1), p, 0), ValueError),
        (lambda: win.Get(bytes(8), 0, 0), ValueError),  # read-only origin
    ]
    for i, (call, exc) in enumerate(bad):
        try:
            await call()
        except exc:
            pass
        else:
            raise AssertionError(f"bad call {i} accepted")
    await win.Fence()
    assert not win.memory.any()
    await win.Free()
    try:
        await win.Put(np.ones(1), 0, 0)
    except ucxcomm.ClosedError:
        pass
    else:
        raise AssertionError("Put after Free")


@case
async def busy_target(comm):
    """Rank 0 computes without awaiting while the others hammer its window with
    Fetch_and_op, Put and Get: its RMA progress thread serves them all."""
    p, r = comm.size, comm.rank
    win = await ucxcomm.Win.Allocate(comm, 8 * 16, disp_unit=8)
    n = 50
    await comm.barrier()
    if r == 0:
        counter = win.memory.view(np.int64)
        deadline = time.monotonic() + 60
        spins = 0
        while counter[0] < n * (p - 1) and time.monotonic() < deadline:
            spins += 1  # pure computation: no await, no event loop
        assert counter[0] == n * (p - 1), (counter[0], spins)
    else:
        for _ in range(n):
            await win.Fetch_and_op(1, 0, 0)
        await win.Put(np.full(1, 7, np.int64), 0, 1 + r)
        got = np.zeros(1, np.int64)
        await win.Get(got, 0, 0)
        assert got[0] >= n
        await win.Flush(0)
    await win.Fence()
    if r == 0:
        assert (win.memory.view(np.int64)[2:1 + p] == 7).all()
    await win.Free()


if __name__ == "__main__":
    cases.main()

"""SPMD cases of the flight recorder (``comm.trace()``; tests/test_trace.py). Run one:
``ucxcomm run -n 2 python tests/spmd/trace_cases.py NAME``; each rank prints ``CASE-OK
NAME rank R`` when its assertions passed.
"""

from __future__ import annotations

import asyncio

import numpy as np

import ucxcomm
from ucxcomm.testing import Cases

cases = Cases()
case = cases.case


def _calls(ops, first):
    """``(kind, state, peer, tag, seq)`` of ``ops`` from the ``first``-th on."""
    return [(o.kind, o.state, o.peer, o.tag, o.seq) for o in ops[first:]]


@case
async def records_known_traffic(comm):
    """Every kind of call this rank made, in order, with its peer or root, tag,
    sequence number and final state; the compiled and the Python paths alike; a dup's
    records are its own."""
    r, p = comm.rank, comm.size
    right, left = (r + 1) % p, (r - 1) % p
    await comm.barrier()
    start = len(comm.trace())
    seq0 = comm.trace()[-1].seq + 1
    small, big = np.full(1, r, np.float64), np.full(1 << 18, r, np.float64)  # 8 B, 2 MiB
    got_small, got_big = np.empty_like(small), np.empty_like(big)
    # point-to-point, each way round the ring: small blocking, large non-blocking
    reqs = [comm.Irecv(got_small, left, tag=3)]
    await comm.Send(small, right, tag=3)
    await reqs[0]
    rreq = comm.Irecv(got_big, left, tag=4)
    await comm.Isend(big, right, tag=4)
    await rreq
    await comm.Allreduce(small, got_small)              # compiled
    await comm.Allreduce(big, got_big)                  # general (ring)
    await comm.Bcast(big, root=p - 1)
    await comm.Iallreduce(small, got_small)
    assert await comm.allgather(r) == list(range(p))
    await comm.send({"r": r}, right, tag=6)
    assert await comm.recv(left, tag=6) == {"r": left}
    ops = comm.trace()
    want = [("Irecv", "done", left, 3, None), ("Send", "done", right, 3, None),
            ("Irecv", "done", left, 4, None), ("Send", "done", right, 4, None),
            ("Allreduce", "done", None, None, seq0), ("Allreduce", "done", None, None, seq0 + 1),
            ("Bcast", "done", p - 1, None, seq0 + 2), ("Allreduce", "done", None, None, seq0 + 3),
            ("allgather", "done", None, None, seq0 + 4), ("send", "done", right, 6, None),
            ("recv", "done", left, 6, None)]
    assert _calls(ops, start) == want, _calls(ops, start)
    for o in ops[start:]:
        assert o.rank == r and o.size == p and o.cid == 0 and o.end >= o.start > 0, o
        assert o.world_peer == o.peer, o
    await comm.Bcast(big, root=p - 1, timeout=60)  # (the deadline's path keeps the root)
    assert (comm.trace()[-1].kind, comm.trace()[-1].peer) == ("Bcast", p - 1)
    dup = await comm.dup()
    await dup.barrier()
    assert [(o.kind, o.seq, o.cid) for o in dup.trace()] == [("barrier", 0, dup.group.cid)]
    assert {o.cid for o in comm.trace()} == {0}  # (the dup's records are its own)
    await dup.close()


@case
async def in_flight_records_stay(comm):
    """With a 4-record recorder (UCXCOMM_TRACE_DEPTH=4, set by the test): a receive
    still in flight is never overwritten by the 20 barriers after it; it ends done; a
    cancelled one ends cancelled."""
    r = comm.rank
    buf = np.zeros(2)
    req = comm.Irecv(buf, 1 - r, tag=9) if r < 2 else None
    for _ in range(20):
        await comm.barrier()
    ops = comm.trace()
    assert len(ops) == 4, ops
    if req is not None:
        assert [(o.kind, o.state, o.tag) for o in ops if o.kind == "Irecv"] == \
            [("Irecv", "posted", 9)], ops
    await comm.barrier()  # (every rank has looked before any sends)
    if req is not None:
        await comm.Send(np.ones(2), 1 - r, tag=9)
        await req
        await asyncio.sleep(0)  # (a future's done-callbacks run on the loop's next turn)
        assert [o.state for o in comm.trace() if o.kind == "Irecv"] == ["done"], comm.trace()
        gone = comm.Irecv(buf, 1 - r, tag=10)
        assert gone.cancel()
        await asyncio.sleep(0)
        assert [o.state for o in comm.trace() if o.tag == 10] == ["cancelled"]
    await comm.barrier()
    assert len(comm.trace()) == 4


@case
async def failed_and_timed_out_calls(comm):
    """A receive that does not fit ends failed (TruncationError); a collective given up
    by its deadline ends cancelled, and what raised before any I/O is not recorded."""
    r = comm.rank
    if r == 0:
        await comm.Send(np.ones(8), 1, tag=2)
    elif r == 1:
        try:
            await comm.Recv(np.zeros(2), 0, tag=2)
        except ucxcomm.TruncationError:
            pass
        else:
            raise AssertionError("the receive fitted")
        assert comm.trace()[-1].state == "failed", comm.trace()[-1]
    before = len(comm.trace())
    try:
        await comm.Send(np.ones(1), comm.size + 5)
    except ValueError:
        pass
    assert len(comm.trace()) == before
    dup = await comm.dup()
    if r == 0:
        try:
            await dup.Allreduce(np.ones(1 << 16), np.empty(1 << 16), timeout=0.2)
        except ucxcomm.CommTimeoutError:
            pass
        else:
            raise AssertionError("the lone Allreduce completed")
        assert dup.trace()[-1].kind == "Allreduce" and dup.trace()[-1].state == "cancelled"
    await comm.barrier()
    await dup.close()


@case
async def window_synchronization(comm):
    """Fence, Lock and Unlock are recorded with their target; a Lock that waits for
    another rank's exclusive one is in flight in the records while it waits."""
    r, p = comm.rank, comm.size
    win = await ucxcomm.Win.Allocate(comm, 64)
    await win.Fence()
    await win.Lock(0)
    await win.Unlock(0)
    ops = [(o.kind, o.peer, o.state) for o in comm.trace() if o.kind.startswith("Win.")]
    assert ops == [("Win.Fence", None, "done"), ("Win.Lock", 0, "done"),
                   ("Win.Unlock", 0, "done")], ops
    assert [o.call() for o in comm.trace() if o.kind == "Win.Lock"] == ["Win.Lock(rank=0)"]
    await comm.barrier()
    if r == 0:
        await win.Lock(p - 1)
    await comm.barrier()
    if r == 1:  # waits for rank 0's exclusive lock
        task = asyncio.ensure_future(win.Lock(p - 1))
        done, _ = await asyncio.wait([task], timeout=0.5)  # (held: it cannot finish)
        assert not done
        assert [o.call() for o in comm.trace() if o.kind == "Win.Lock" and o.in_flight] \
            == [f"Win.Lock(rank={p - 1})"], comm.trace()
        await comm.send("waiting", 0, tag=1)
        await task
        await win.Unlock(p - 1)
    elif r == 0:
        assert await comm.recv(1, tag=1) == "waiting"
        await win.Unlock(p - 1)
    await win.Free()


@case
async def recorder_off(comm):
    """UCXCOMM_TRACE_DEPTH=0 (set by the test): nothing recorded, everything works."""
    x = np.ones(4)
    await comm.Allreduce(x.copy(), x)
    await comm.barrier()
    assert comm.trace() == []


if __name__ == "__main__":
    cases.main()

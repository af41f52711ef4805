"""SPMD cases of collective fingerprints (``CollectiveMismatch``; tests/test_mismatch.py).
Run one: ``ucxcomm run -n 3 python tests/spmd/mismatch_cases.py NAME``; each rank prints
``CASE-OK NAME rank R`` when its assertions passed.

Each scenario makes the ranks call collectives that do not match (another collective,
count, dtype, op, root, per-rank counts, a buffer collective against an object one),
every call under a deadline: every rank must raise ``CollectiveMismatch`` naming the
calls, leave its receive buffer unwritten, and then complete a matching Allreduce on the
same communicator.
"""

from __future__ import annotations

import asyncio

import numpy as np

import ucxcomm
from ucxcomm.testing import Cases

cases = Cases()
case = cases.case

T = 20.0  # each call's deadline: a hang fails the case instead of hanging it
SENTINEL = -7.0


def _scenarios(comm):
    """``(name, coroutine factory for this rank, substrings every rank's error holds,
    receive buffer that must stay unwritten or None)``."""
    r, p = comm.rank, comm.size
    last = p - 1
    out: list = []

    buf = np.full(8 if r != 1 else 4, SENTINEL)
    out.append(("count", lambda: comm.Allreduce(np.ones(buf.size), buf, timeout=T),
                ["rank 1 called Allreduce(float64[4], SUM)", "Allreduce(float64[8], SUM)"],
                buf))

    kbuf = np.full(4, SENTINEL)
    out.append(("kind", (lambda: comm.Bcast(kbuf, root=0, timeout=T)) if r == last and r != 0
                else (lambda: comm.Allreduce(np.ones(4), kbuf, timeout=T)),
                [f"rank {last} called Bcast(float64[4], root=0)",
                 "called Allreduce(float64[4], SUM)"], kbuf))

    dt = np.int64 if r == 1 else np.float64
    dbuf = np.full(4, -7, dt)
    out.append(("dtype", lambda: comm.Allreduce(np.ones(4, dt), dbuf, timeout=T),
                ["rank 1 called Allreduce(int64[4], SUM)", "Allreduce(float64[4], SUM)"],
                dbuf))

    obuf = np.full(4, SENTINEL)
    out.append(("op", lambda: comm.Allreduce(np.ones(4), obuf,
                                             op=ucxcomm.MAX if r == 0 else ucxcomm.SUM,
                                             timeout=T),
                ["rank 0 called Allreduce(float64[4], MAX)", "Allreduce(float64[4], SUM)"],
                obuf))

    rbuf = np.full(4, SENTINEL) if r != 0 else np.ones(4)
    out.append(("root", lambda: comm.Bcast(rbuf, root=1 if r == 0 else 0, timeout=T),
                ["rank 0 called Bcast(float64[4], root=1)", "called Bcast(float64[4], root=0)"],
                rbuf if r != 0 else None))

    xbuf = np.full(1, SENTINEL)
    out.append(("object vs buffer", (lambda: comm.allreduce(3, timeout=T)) if r == 0
                else (lambda: comm.Allreduce(np.ones(1), xbuf, timeout=T)),
                ["rank 0 called allreduce(SUM)", "called Allreduce(float64[1], SUM)"],
                None if r == 0 else xbuf))

    n = 1 << 15  # 256 KiB: the general form (a round of fingerprints, then the ring)
    lbuf = np.full(n + (r == 0), SENTINEL)
    out.append(("large count", lambda: comm.Allreduce(np.ones(lbuf.size), lbuf, timeout=T),
                [f"rank 0 called Allreduce(float64[{n + 1}], SUM)",
                 f"Allreduce(float64[{n}], SUM)"], lbuf))

    gbuf = np.full(4 * p, SENTINEL)
    out.append(("barrier", (lambda: comm.barrier(timeout=T)) if r == 0
                else (lambda: comm.Allgather(np.ones(4), gbuf, timeout=T)),
                ["rank 0 called barrier()", "called Allgather(float64[4])"],
                None if r == 0 else gbuf))

    # Alltoallv: rank 0 sends rank 1 two elements; rank 1 expects three from it.
    scounts = [2] * p
    rcounts = [3 if (r == 1 and q == 0) else 2 for q in range(p)]
    vbuf = np.full(sum(rcounts), SENTINEL)
    out.append(("alltoallv counts", lambda: comm.Alltoallv(
        (np.ones(sum(scounts)), scounts), (vbuf, rcounts), timeout=T),
        ["rank 0 sends 2 elements to rank 1, which expects 3 from it"], vbuf))

    # Alltoallv with the same counts on every rank that still disagree between ranks
    # (rank p sends q+1 elements to rank q, which expects p+1 from it): every rank's
    # fingerprint is the same bytes, the verdict's rules between ranks must still run.
    same = [q + 1 for q in range(p)]
    sabuf = np.full(sum(same), SENTINEL)
    out.append(("alltoallv same counts", lambda: comm.Alltoallv(
        (np.ones(sum(same)), same), (sabuf, same), timeout=T),
        ["rank 0 sends 2 elements to rank 1, which expects 1 from it"], sabuf))

    # Gatherv: rank 1 sends 5 elements where the root expects 4.
    gcounts = [4] * p
    gvbuf = np.full(4 * p, SENTINEL) if r == 0 else None
    out.append(("gatherv counts", lambda: comm.Gatherv(
        np.ones(5 if r == 1 else 4), (gvbuf, gcounts) if r == 0 else None, root=0,
        timeout=T), ["rank 1 sends 5 elements to the root (rank 0), which expects 4"], gvbuf))

    ibuf = np.full(2 if r else 3, SENTINEL)

    async def nonblocking():
        await asyncio.wait_for(comm.Iallreduce(np.ones(ibuf.size), ibuf), T)

    out.append(("non-blocking", nonblocking, ["rank 0 called Allreduce(float64[3], SUM)",
                                              "Allreduce(float64[2], SUM)"], ibuf))

    sbuf = np.full(2, SENTINEL)
    out.append(("reduce_scatter_block op", lambda: comm.Reduce_scatter_block(
        np.ones(2 * p), sbuf, op=ucxcomm.PROD if r == last else ucxcomm.SUM, timeout=T),
        [f"rank {last} called Reduce_scatter_block(float64[{2 * p}], PROD)"], sbuf))

    out.append(("object root", lambda: comm.bcast("x", root=1 if r == last else 0, timeout=T),
                [f"rank {last} called bcast(root=1)", "called bcast(root=0)"], None))
    return out


async def _usable(comm):
    got = np.empty(2)
    await comm.Allreduce(np.full(2, float(comm.rank)), got, timeout=T)
    assert (got == sum(range(comm.size))).all(), got


@case
async def every_mismatch_raises_everywhere(comm):
    """Each scenario: CollectiveMismatch on every rank, the same text everywhere, both
    calls named, the receive buffer unwritten; then a matching collective works."""
    assert comm.size >= 2
    await comm.barrier(timeout=T)
    for name, call, expect, buf in _scenarios(comm):
        try:
            await call()
        except ucxcomm.CollectiveMismatch as exc:
            text = str(exc)
            for e in expect:
                assert e in text, (name, e, text)
            assert exc.calls and len(exc.calls) == comm.size, (name, exc.calls)
        else:
            raise AssertionError(f"{name}: rank {comm.rank} raised nothing")
        if buf is not None:
            assert (buf == SENTINEL).all() or (buf == -7).all(), (name, buf)
        # every rank raised the same text (object collectives compare it)
        texts = await comm.allgather(text, timeout=T)
        assert len(set(texts)) == 1, (name, texts)
        await _usable(comm)


@case
async def matching_calls_of_mixed_buffers(comm):
    """Ranks that agree on the call but pass different kinds of host buffer (numpy,
    bytearray, memoryview, a strided view's copy, IN_PLACE) still match."""
    r, p = comm.rank, comm.size
    data = np.arange(8, dtype=np.uint8) + 10
    if r == 0:
        buf = bytearray(data.tobytes())
    elif r == 1:
        buf = memoryview(bytearray(8))
    else:
        buf = np.zeros(8, np.uint8)
    await comm.Bcast(buf, root=0, timeout=T)
    assert bytes(buf) == data.tobytes()
    mine = np.full(4, r, np.int64)
    got = np.empty(4 * p, np.int64)
    if r == 1:
        got[4:8] = mine
        await comm.Allgather(ucxcomm.IN_PLACE, got, timeout=T)
    else:
        await comm.Allgather(mine, got, timeout=T)
    assert (got.reshape(p, 4) == np.arange(p)[:, None]).all(), got
    acc = np.full(3, float(r + 1))
    await comm.Allreduce(ucxcomm.IN_PLACE if r == 0 else acc.copy(), acc, timeout=T)
    assert (acc == sum(range(1, p + 1))).all(), acc


@case
async def failures_fail_everywhere(comm):
    """A collective that fails on one rank fails on every rank: a user op that raises,
    an object that does not pickle (the others get CollectiveError naming the rank)."""
    r = comm.rank
    try:
        await comm.allreduce({"a": 1}, timeout=T)  # dict + dict raises where it is reduced
    except TypeError:
        pass
    except ucxcomm.CollectiveError as exc:
        assert "TypeError" in str(exc), exc
    else:
        raise AssertionError(f"allreduce of dicts raised nothing on rank {r}")
    try:
        await comm.allgather((lambda: 0) if r == 1 else 1, timeout=T)
    except ucxcomm.CollectiveError as exc:
        assert r != 1 and exc.rank == 1, (r, exc)
    except Exception as exc:  # the rank whose object does not pickle: its own error
        assert r == 1 and not isinstance(exc, ucxcomm.UcxCommError), (r, exc)
    else:
        raise AssertionError(f"allgather of a lambda raised nothing on rank {r}")
    await _usable(comm)


if __name__ == "__main__":
    cases.main()

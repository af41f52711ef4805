"""SPMD collective cases, checked against numpy references computed from every rank's
(deterministic) input. Run one: ``ucxcomm run -n 3 python tests/spmd/coll_cases.py NAME``;
each rank prints ``CASE-OK NAME rank R`` when its assertions passed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os

import numpy as np

import ucxcomm
from ucxcomm import IN_PLACE
from ucxcomm.comm import algorithms
from ucxcomm.testing import Cases, refuses_timeout

cases = Cases()
case = cases.case


BUFFER_OPS = [ucxcomm.SUM, ucxcomm.PROD, ucxcomm.MIN, ucxcomm.MAX, ucxcomm.LAND,
              ucxcomm.LOR, ucxcomm.BAND, ucxcomm.BOR, ucxcomm.BXOR]
DTYPES = [np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64,
          np.complex64, np.complex128, np.bool_]
SEG = 1 << 20
# 1 element, odd sizes, around the recursive-doubling/ring switch, more than one segment.
SIZES = [1, 7, 4097, 70001]


def inp(rank, n, dtype, salt=0):
    """Rank ``rank``'s input: small values (exact sums), near 1 for products."""
    dtype = np.dtype(dtype)
    k = (np.arange(n, dtype=np.int64) * 7 + rank * 13 + salt) % 5
    if dtype.kind == "b":
        return (k % 2).astype(dtype)
    if dtype.kind in "fc":
        x = (1 + k / 8).astype(dtype)
        if dtype.kind == "c":
            x = x + 1j * (k % 3).astype(dtype)
        return x.astype(dtype)
    return (k + 1).astype(dtype)


def valid(op, dtype):
    dtype = np.dtype(dtype)
    if op.name in ("BAND", "BOR", "BXOR") and dtype.kind in "fc":
        return False
    return not (op.name in ("MIN", "MAX") and dtype.kind == "c")


def reference(op, arrays):
    ufunc = getattr(np, op.ufunc)
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = ufunc(acc, a, out=np.empty_like(acc))
    return acc


def check(got, want, what):
    if got.dtype.kind in "fc":
        tol = 1e-2 if got.dtype in (np.float16,) else 1e-5
        assert np.allclose(got, want, rtol=tol, atol=0), (what, got[:8], want[:8])
    else:
        assert np.array_equal(got, want), (what, got[:8], want[:8])


async def same_everywhere(comm, arr, what):
    digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    digests = await comm.allgather(digest)
    assert len(set(digests)) == 1, (what, digests)


@case
async def allreduce_ops_dtypes(comm):
    """Every op x dtype on small sizes, SUM/MAX on large ones; results bit-identical."""
    p = comm.size
    for dtype in DTYPES:
        for op in BUFFER_OPS:
            if not valid(op, dtype):
                continue
            for n in SIZES if op.name in ("SUM", "MAX") else SIZES[:2]:
                send = inp(comm.rank, n, dtype)
                recv = np.zeros(n, dtype)
                await comm.Allreduce(send, recv, op)
                want = reference(op, [inp(r, n, dtype) for r in range(p)])
                check(recv, want, (op, dtype, n))
                if n > 1000 and dtype in (np.float32, np.float16):
                    await same_everywhere(comm, recv, (op, dtype, n))


@case
async def allreduce_large_and_in_place(comm):
    """More than one segment per ring block (uneven blocks), in place, 2-D arrays."""
    p = comm.size
    n = 3 * SEG // 4 * p + 5  # float32: > 1 segment per block
    send = inp(comm.rank, n, np.float32, 1)
    recv = np.empty(n, np.float32)
    await comm.Allreduce(send, recv)
    want = reference(ucxcomm.SUM, [inp(r, n, np.float32, 1) for r in range(p)])
    check(recv, want, "large")
    await same_everywhere(comm, recv, "large")
    buf = inp(comm.rank, n, np.int64, 2).reshape(-1, 5) if n % 5 == 0 else \
        inp(comm.rank, n, np.int64, 2)
    await comm.Allreduce(IN_PLACE, buf, ucxcomm.MAX)
    check(buf.ravel(), reference(ucxcomm.MAX, [inp(r, n, np.int64, 2) for r in range(p)]),
          "in place")
    mat = np.asfortranarray(inp(comm.rank, 60, np.float64).reshape(6, 10))
    out = np.zeros_like(mat)  # F order too: same element order
    await comm.Allreduce(mat, out)
    want = sum(np.asfortranarray(inp(r, 60, np.float64).reshape(6, 10)) for r in range(p))
    check(out.ravel(order="K"), want.ravel(order="K"), "F order")
    # Other buffer kinds: bytearray (uint8), typed memoryview.
    ba = bytearray(inp(comm.rank, 33, np.uint8).tobytes())
    await comm.Allreduce(IN_PLACE, ba, ucxcomm.BXOR)
    want = reference(ucxcomm.BXOR, [inp(r, 33, np.uint8) for r in range(p)])
    assert bytes(ba) == want.tobytes()


@case
async def bcast_reduce_every_root(comm):
    p = comm.size
    for root in range(p):
        for n in (0, 1, 8193, 3 * SEG // 8 + 5):
            buf = inp(root, n, np.float64) if comm.rank == root else np.zeros(n, np.float64)
            await comm.Bcast(buf, root=root)
            check(buf, inp(root, n, np.float64), ("bcast", root, n))
            send = inp(comm.rank, n, np.int32, root)
            recv = np.zeros(n, np.int32) if comm.rank == root else None
            await comm.Reduce(send, recv, ucxcomm.SUM, root=root)
            if comm.rank == root:
                want = reference(ucxcomm.SUM, [inp(r, n, np.int32, root) for r in range(p)])
                check(recv, want, ("reduce", root, n))
        # IN_PLACE at the root
        buf = inp(comm.rank, 100, np.float32)
        await comm.Reduce(IN_PLACE if comm.rank == root else buf,
                          buf if comm.rank == root else None, ucxcomm.MIN, root=root)
        if comm.rank == root:
            check(buf, reference(ucxcomm.MIN, [inp(r, 100, np.float32) for r in range(p)]),
                  "reduce in place")
    # read-only send buffer at the root of a broadcast is fine
    ro = np.arange(10.0)
    ro.flags.writeable = False
    await comm.Bcast(ro if comm.rank == 0 else np.zeros(10), root=0)


@case
async def gather_scatter_allgather(comm):
    p, r = comm.size, comm.rank
    for n in (1, 5, 3 * SEG // 8 + 1):
        mine = inp(r, n, np.int64)
        everyone = np.concatenate([inp(q, n, np.int64) for q in range(p)])
        for root in range(p):
            recv = np.zeros(n * p, np.int64) if r == root else None
            await comm.Gather(mine, recv, root=root)
            if r == root:
                check(recv, everyone, ("gather", n))
            out = np.zeros(n, np.int64)
            await comm.Scatter(everyone if r == root else None, out, root=root)
            check(out, mine, ("scatter", n))
        allg = np.zeros(n * p, np.int64)
        await comm.Allgather(mine, allg)
        check(allg, everyone, ("allgather", n))
        inplace = np.zeros(n * p, np.int64)
        inplace[r * n:(r + 1) * n] = mine
        await comm.Allgather(IN_PLACE, inplace)
        check(inplace, everyone, ("allgather in place", n))
    # IN_PLACE Gather / Scatter at the root
    n = 4
    everyone = np.concatenate([inp(q, n, np.int16) for q in range(p)])
    buf = np.zeros(n * p, np.int16)
    if r == 0:
        buf[:n] = inp(0, n, np.int16)
    await comm.Gather(IN_PLACE if r == 0 else inp(r, n, np.int16), buf if r == 0 else None)
    if r == 0:
        check(buf, everyone, "gather in place")
    out = np.zeros(n, np.int16)
    await comm.Scatter(everyone if r == 0 else None, IN_PLACE if r == 0 else out)
    if r != 0:
        check(out, inp(r, n, np.int16), "scatter in place")


@case
async def v_variants(comm):
    """Gatherv/Scatterv/Allgatherv/Alltoallv with zero counts and explicit displacements."""
    p, r = comm.size, comm.rank
    counts = [(q * 3) % 4 for q in range(p)]  # rank 0 sends nothing
    displs = [sum(counts[:q]) + q for q in range(p)]  # gaps between blocks
    total = displs[-1] + counts[-1] + 1
    mine = inp(r, counts[r], np.float32)
    want = np.full(total, -1, np.float32)
    for q in range(p):
        want[displs[q]:displs[q] + counts[q]] = inp(q, counts[q], np.float32)
    for root in range(p):
        recv = np.full(total, -1, np.float32) if r == root else None
        await comm.Gatherv(mine, (recv, counts, displs) if r == root else None, root=root)
        if r == root:
            check(recv, want, ("gatherv", root))
        out = np.full(counts[r], -2, np.float32)
        await comm.Scatterv((want, counts, displs) if r == root else None, out, root=root)
        check(out, mine, ("scatterv", root))
    allg = np.full(total, -1, np.float32)
    await comm.Allgatherv(mine, (allg, counts, displs))
    check(allg, want, "allgatherv")
    # Alltoallv: rank i sends (i + j) % 3 elements to rank j, value 100*i + j.
    scounts = [(r + j) % 3 for j in range(p)]
    rcounts = [(i + r) % 3 for i in range(p)]
    send = np.concatenate([np.full(scounts[j], 100 * r + j, np.int32) for j in range(p)])
    recv = np.full(sum(rcounts), -1, np.int32)
    await comm.Alltoallv((send, scounts), (recv, rcounts))
    wantv = np.concatenate([np.full(rcounts[i], 100 * i + r, np.int32) for i in range(p)])
    check(recv, wantv, "alltoallv")


@case
async def alltoall_and_reduce_scatter(comm):
    p, r = comm.size, comm.rank
    for n in (1, 3, 3 * SEG // 8 + 7):
        send = np.concatenate([np.full(n, 1000 * r + j, np.int64) for j in range(p)])
        recv = np.zeros(n * p, np.int64)
        await comm.Alltoall(send, recv)
        want = np.concatenate([np.full(n, 1000 * i + r, np.int64) for i in range(p)])
        check(recv, want, ("alltoall", n))
        buf = send.copy()
        await comm.Alltoall(IN_PLACE, buf)
        check(buf, want, ("alltoall in place", n))
        # Reduce_scatter_block
        full = [inp(q, n * p, np.float64, n) for q in range(p)]
        total = reference(ucxcomm.SUM, full)
        out = np.zeros(n, np.float64)
        await comm.Reduce_scatter_block(full[r], out)
        check(out, total[r * n:(r + 1) * n], ("rsb", n))
        await same_everywhere(comm, np.concatenate(await comm.allgather(out)), "rsb")
        inplace = full[r].copy()
        await comm.Reduce_scatter_block(IN_PLACE, inplace, ucxcomm.SUM)
        check(inplace[:n], total[r * n:(r + 1) * n], ("rsb in place", n))
    # Reduce_scatter with uneven counts, including zeros.
    counts = [(q * 5 + 2) % 7 for q in range(p)]
    counts[0] = 0
    n = sum(counts)
    full = [inp(q, n, np.int32, 9) for q in range(p)]
    total = reference(ucxcomm.BXOR, full)
    out = np.zeros(max(counts[r], 1), np.int32)
    await comm.Reduce_scatter(full[r], out, counts, ucxcomm.BXOR)
    lo = sum(counts[:r])
    check(out[:counts[r]], total[lo:lo + counts[r]], "reduce_scatter")


@case
async def scans(comm):
    r = comm.rank
    for n in (1, 9, 5000):
        for op in (ucxcomm.SUM, ucxcomm.MAX, ucxcomm.PROD):
            send = inp(r, n, np.int64, n)
            recv = np.full(n, -7, np.int64)
            await comm.Scan(send, recv, op)
            check(recv, reference(op, [inp(q, n, np.int64, n) for q in range(r + 1)]),
                  ("scan", op, n))
            recv = np.full(n, -7, np.int64)
            await comm.Exscan(send, recv, op)
            if r == 0:
                assert (recv == -7).all()  # untouched
            else:
                check(recv, reference(op, [inp(q, n, np.int64, n) for q in range(r)]),
                      ("exscan", op, n))
    buf = inp(r, 10, np.float64)
    await comm.Scan(IN_PLACE, buf)
    check(buf, reference(ucxcomm.SUM, [inp(q, 10, np.float64) for q in range(r + 1)]),
          "scan in place")


@case
async def objects(comm):
    p, r = comm.size, comm.rank
    for root in range(p):
        got = await comm.bcast({"root": root, "arr": np.arange(5)} if r == root else None,
                               root=root)
        assert got["root"] == root and np.array_equal(got["arr"], np.arange(5))
        red = await comm.reduce(r + 1, ucxcomm.SUM, root=root)
        assert red == (p * (p + 1) // 2 if r == root else None), red
        g = await comm.gather((r, "x" * r), root=root)
        assert g == ([(q, "x" * q) for q in range(p)] if r == root else None)
        s = await comm.scatter([q * q for q in range(p)] if r == root else None, root=root)
        assert s == r * r
        # Non-commutative user op: string concatenation keeps rank order.
        cat = await comm.reduce(str(r), lambda a, b: a + b, root=root)
        assert cat == ("".join(str(q) for q in range(p)) if r == root else None)
    assert await comm.allreduce(str(r), lambda a, b: a + b) == "".join(map(str, range(p)))
    assert await comm.allreduce(np.full(3, r)) is not None
    assert await comm.allreduce({r}, ucxcomm.BOR) == set(range(p))
    assert await comm.allgather(r * 10) == [q * 10 for q in range(p)]
    assert await comm.alltoall([(r, j) for j in range(p)]) == [(i, r) for i in range(p)]
    assert await comm.scan([r], ucxcomm.SUM) == list(range(r + 1))
    ex = await comm.exscan([r], lambda a, b: a + b)
    assert ex == (None if r == 0 else list(range(r)))
    # MAXLOC / MINLOC on (value, index) pairs; ties go to the lowest index.
    assert await comm.allreduce((r % 2, r), ucxcomm.MAXLOC) == ((1, 1) if p > 1 else (0, 0))
    assert await comm.allreduce((r % 2, r), ucxcomm.MINLOC) == (0, 0)
    big = await comm.allreduce(np.full(1 << 18, r, np.float64))
    assert (big == sum(range(p))).all()
    await comm.barrier()


@case
async def nonblocking_overlap(comm):
    """Several non-blocking collectives and point-to-point messages in flight at once."""
    p, r = comm.size, comm.rank
    n = 3 * SEG // 8 + 11
    a = inp(r, n, np.float64)
    ar = np.zeros(n, np.float64)
    b = np.arange(1000, dtype=np.int32) * (r == 1) if p > 1 else np.arange(1000, dtype=np.int32)
    small = np.full(4, r, np.int64)
    smallr = np.zeros(4 * p, np.int64)
    right, left = (r + 1) % p, (r - 1) % p
    p2p_in = np.zeros(n, np.float64)
    reqs = [comm.Iallreduce(a, ar), comm.Ibcast(b, root=1 % p),
            comm.Iallgather(small, smallr), comm.ibarrier(),
            comm.Isend(a, right, tag=3), comm.Irecv(p2p_in, left, tag=3)]
    # The application computes while they progress.
    total = 0.0
    for _ in range(5):
        total += float(np.sum(a))
        await asyncio.sleep(0)
    await ucxcomm.Request.waitall(reqs)
    check(ar, reference(ucxcomm.SUM, [inp(q, n, np.float64) for q in range(p)]), "iallreduce")
    assert np.array_equal(b, np.arange(1000, dtype=np.int32))
    check(smallr, np.repeat(np.arange(p, dtype=np.int64), 4), "iallgather")
    check(p2p_in, inp(left, n, np.float64), "p2p during collectives")
    ok, _ = reqs[0].test()
    assert ok


@case
async def bad_input(comm):
    """Each mistake raises at the call, before any I/O; the communicator stays usable."""
    p = comm.size
    x = np.zeros(8, np.float32)
    bad = [
        (lambda: comm.Allreduce(x, np.zeros(9, np.float32)), ValueError),
        (lambda: comm.Allreduce(x, np.zeros(8, np.float64)), TypeError),
        (lambda: comm.Allreduce(x, np.zeros(8, np.float32), ucxcomm.BAND), TypeError),
        (lambda: comm.Allreduce(x, np.zeros(8, np.float32), ucxcomm.MAXLOC), TypeError),
        (lambda: comm.Allreduce(x, np.zeros(8, np.float32), lambda a, b: a), TypeError),
        (lambda: comm.Allreduce(np.zeros(4, np.complex64), np.zeros(4, np.complex64),
                                ucxcomm.MAX), TypeError),
        (lambda: comm.Allreduce(x, np.zeros(16, np.float32)[::2]), ValueError),
        (lambda: comm.Allreduce(x, bytes(32)), ValueError),  # read-only receive buffer
        (lambda: comm.Allreduce(x, None), TypeError),
        (lambda: comm.Bcast(x, root=p), ValueError),
        (lambda: comm.Reduce(x, np.zeros(8, np.float32), root=-1), ValueError),
        (lambda: comm.Allgather(x, np.zeros(8 * p + 1, np.float32)), ValueError),
        (lambda: comm.Allgather(x, np.zeros(8 * p + p, np.float32)), ValueError),
        (lambda: comm.Alltoall(np.zeros(2 * p, np.int8), np.zeros(3 * p, np.int8)), ValueError),
        (lambda: comm.Allgatherv(x, (np.zeros(8 * p, np.float32), [8] * (p + 1))), ValueError),
        (lambda: comm.Allgatherv(x, (np.zeros(8 * p, np.float32), [8] * p, [1] * p)),
         ValueError),  # blocks fall outside the buffer for rank p-1... or overlap
        (lambda: comm.Reduce_scatter(np.zeros(4, np.int32), np.zeros(4, np.int32),
                                     [5] * p), ValueError),
        (lambda: comm.Reduce_scatter_block(np.zeros(p + 1, np.int32) if p > 1 else
                                           np.zeros(3, np.int32), np.zeros(2, np.int32)),
         ValueError),
        (lambda: comm.Scan(x, np.zeros(7, np.float32)), ValueError),
        (lambda: comm.scatter(None, root=p), ValueError),
        (lambda: comm.bcast(None, root=-1), ValueError),
        (lambda: comm.alltoall([1] * (p + 1)), ValueError),
        (lambda: comm.allreduce(1, op="sum"), TypeError),
    ]
    if p > 1:  # overlapping/outside blocks
        bad[15] = (lambda: comm.Allgatherv(x, (np.zeros(8 * p, np.float32), [8] * p,
                                                [8 * p] * p)), ValueError)
    for i, (call, exc) in enumerate(bad):
        keep = x.copy()
        try:
            await call()
        except exc:
            pass
        else:
            raise AssertionError(f"bad call {i} did not raise {exc.__name__}")
        assert np.array_equal(x, keep)
    # Nothing was consumed: the next collectives still match up on every rank.
    out = np.zeros(8, np.float32)
    await comm.Allreduce(np.ones(8, np.float32), out)
    assert (out == p).all()
    assert await comm.allgather(comm.rank) == list(range(p))


@case
async def object_buffers_refused(comm):
    """Regression: numpy dtype=object arrays passed every buffer check, so raw PyObject
    pointers went on the wire (the receiver segfaulted; Allreduce crashed both ranks).
    Buffers holding object references now raise TypeError at the call, before any I/O,
    for messages, collectives and windows; the communicator stays in step."""
    p, r = comm.size, comm.rank
    obj = np.array([object(), None, 1.5, "x"] * p, dtype=object)
    rec = np.zeros(4 * p, dtype=[("v", "f8"), ("o", "O")])  # an object field
    peer = (r + 1) % p
    bad = [
        lambda: comm.Send(obj, peer),
        lambda: comm.Recv(obj, peer),
        lambda: comm.Isend(rec, peer),
        lambda: comm.Irecv(memoryview(obj), peer),
        lambda: comm.Sendrecv(obj, peer, np.zeros(4), peer),
        lambda: comm.Allreduce(obj, obj.copy()),
        lambda: comm.Allreduce(ucxcomm.IN_PLACE, obj),
        lambda: comm.Reduce(rec, rec.copy(), root=0),
        lambda: comm.Bcast(obj, root=0),
        lambda: comm.Allgather(obj[:4], obj.copy()),
        lambda: comm.Alltoall(obj, obj.copy()),
        lambda: comm.Reduce_scatter_block(obj, obj[:4].copy()),
        lambda: ucxcomm.Win.Create(comm, obj),
    ]
    for i, call in enumerate(bad):
        try:
            await call()
        except TypeError as exc:
            assert "object" in str(exc), (i, exc)
        else:
            raise AssertionError(f"object buffer call {i} was accepted")
    win = await ucxcomm.Win.Allocate(comm, 64)
    for call in (lambda: win.Put(obj, peer), lambda: win.Get(obj, peer),
                 lambda: win.Accumulate(obj[:2], peer)):
        try:
            await call()
        except TypeError:
            pass
        else:
            raise AssertionError("an object buffer reached a window")
    await win.Free()
    # Nothing moved, nothing was consumed: messages and collectives still line up.
    out = np.zeros(3)
    await comm.Allreduce(np.full(3, r + 1.0), out)
    assert (out == p * (p + 1) / 2).all(), out
    got = np.zeros(2, np.int64)
    req = comm.Irecv(got, (r - 1) % p)
    await comm.Send(np.array([r, 7], np.int64), peer)
    await req
    assert list(got) == [(r - 1) % p, 7]
    assert await comm.allreduce([r]) == list(range(p))


@case
async def mismatched_sizes_named(comm):
    """Regression (issue 15, defect 9): a rank passing a different size to a collective
    gave the others a TruncationError that did not say which collective. Rank 0 passes
    one element more; the other ranks' receives overflow and their errors name the call,
    on the small path and (2 ranks) on the general one. (Rank 0's receives are shorter
    than its buffer: MPI leaves that undefined; here they complete.) With the collective
    checks on (the default, issue 31) every rank raises CollectiveMismatch instead."""
    assert comm.size in (2, 3)
    r = comm.rank
    checks = os.environ.get("UCXCOMM_CHECK_COLLECTIVES", "1") != "0"
    late_root = os.environ.get("UCXCOMM_TEST_LATE_ROOT") == "1"
    calls = [("Bcast", lambda n: comm.Bcast(np.zeros(n), root=0)),
             ("Allreduce", lambda n: comm.Allreduce(np.ones(n), np.zeros(n)))]
    for name, call in calls:
        for n in (4, 5000) if comm.size == 2 else (4,):  # small path, general path
            if late_root:  # the others are in the call before rank 0 sends anything
                if r:
                    await comm.send("in", 0)
                else:
                    for q in range(1, comm.size):
                        assert await comm.recv(q) == "in"
            if checks:  # (issue 31) every rank raises, naming both calls
                try:
                    await call(n + 1 if r == 0 else n)
                except ucxcomm.CollectiveMismatch as exc:
                    assert f"rank 0 called {name}(float64[{n + 1}]" in str(exc), (r, exc)
                    assert f"{name}(float64[{n}]" in str(exc), (r, exc)
                else:
                    raise AssertionError(f"{name} of {n} elements against {n + 1} raised "
                                         f"nothing on rank {r}")
                continue
            try:
                await call(n + 1 if r == 0 else n)
            except ucxcomm.TruncationError as exc:
                assert r and str(exc).startswith(name + ":"), (r, exc)
            else:
                assert r == 0, f"{name} of {n} elements against {n + 1} raised nothing on rank {r}"


@case
async def cancelled_collective(comm):
    """A rank whose collective times out withdraws its receives: its buffer is never
    written afterwards, even though the peer later completes its side (2 ranks)."""
    assert comm.size == 2
    if comm.rank == 0:
        out = np.full(4, -1.0)
        try:
            await asyncio.wait_for(comm.Allreduce(np.ones(4), out), 0.2)
        except TimeoutError:
            pass
        else:
            raise AssertionError("the allreduce completed without its peer")
        await comm.send("go", 1)
        assert await comm.recv(1) == "done"
        assert (out == -1.0).all(), out
    else:
        assert await comm.recv(0) == "go"
        out = np.zeros(4)
        await comm.Allreduce(np.full(4, 2.0), out)  # rank 0's data was sent before
        assert (out == 3.0).all(), out
        await comm.send("done", 0)


@case
async def member_death(comm):
    """A member dies without closing: every rank's pending and later collectives fail
    with PeerFailure, including ranks that were not waiting on the dead one directly."""
    import os

    assert comm.size == 3
    await comm.barrier()
    if comm.rank == 2:
        print(f"CASE-OK member_death rank {comm.rank}", flush=True)
        os._exit(0)  # no close(): the others must find out
    n = 3 * SEG // 4 * 3  # ring allreduce: rank 1 waits on rank 0, not on rank 2
    for attempt in (lambda: comm.Allreduce(np.ones(n, np.float32), np.zeros(n, np.float32)),
                    lambda: comm.bcast("x", root=0),
                    lambda: comm.barrier(),
                    lambda: comm.Allgather(np.ones(4), np.zeros(12))):
        try:
            await asyncio.wait_for(attempt(), 30)
        except ucxcomm.PeerFailure as exc:
            assert exc.peer == 2, exc
        else:
            raise AssertionError("a collective completed without rank 2")
    comm.abort()
    return "aborted"


@case
async def tuning_switch_points(comm):
    """Force each allreduce algorithm on the same inputs: identical results."""
    p, r = comm.size, comm.rank
    n = 10007
    results = []
    saved = dict(algorithms.TUNING)
    try:
        for ring_min, seg in ((1 << 40, SEG), (0, SEG), (0, 4096)):
            algorithms.TUNING["allreduce_ring_min"] = ring_min
            algorithms.TUNING["segment"] = seg
            out = np.zeros(n, np.int64)
            await comm.Allreduce(inp(r, n, np.int64), out)
            results.append(out)
            buf = inp(0, n, np.float32) if r == 0 else np.zeros(n, np.float32)
            await comm.Bcast(buf, root=0)
            check(buf, inp(0, n, np.float32), ("bcast", seg))
    finally:
        algorithms.TUNING.update(saved)
    want = reference(ucxcomm.SUM, [inp(q, n, np.int64) for q in range(p)])
    for out in results:
        check(out, want, "tuning")


@case
async def gpu_collectives(comm):
    """cupy buffers: reductions on the device, transfers through UCX's CUDA transports."""
    import cupy

    p, r = comm.size, comm.rank
    for n in (1, 4097, (1 << 22) + 3):
        send = cupy.asarray(inp(r, n, np.float32))
        recv = cupy.zeros(n, cupy.float32)
        await comm.Allreduce(send, recv)
        want = reference(ucxcomm.SUM, [inp(q, n, np.float32) for q in range(p)])
        check(cupy.asnumpy(recv), want, ("gpu allreduce", n))
        buf = send.copy() if r == 0 else cupy.zeros(n, cupy.float32)
        await comm.Bcast(buf, root=0)
        check(cupy.asnumpy(buf), inp(0, n, np.float32), ("gpu bcast", n))
        allg = cupy.zeros(n * p, cupy.float32)
        await comm.Allgather(send, allg)
        check(cupy.asnumpy(allg), np.concatenate([inp(q, n, np.float32) for q in range(p)]),
              "gpu allgather")
        out = cupy.zeros(n, cupy.float32)
        full = cupy.asarray(inp(r, n * p, np.float32, 3))
        await comm.Reduce_scatter_block(full, out)
        total = reference(ucxcomm.SUM, [inp(q, n * p, np.float32, 3) for q in range(p)])
        check(cupy.asnumpy(out), total[r * n:(r + 1) * n], "gpu rsb")
    try:
        await comm.Allreduce(cupy.zeros(4), np.zeros(4))
    except ValueError:
        pass
    else:
        raise AssertionError("mixing host and GPU buffers was accepted")


@case
async def small_paths_match_general(comm):
    """The small-message paths (C-contiguous host arrays, whole schedule posted at once)
    give exactly what the general algorithms give (Fortran-ordered 2-D copies of the
    same data take those), for every op they serve; reductions bit-identical."""
    p, r = comm.size, comm.rank
    for dtype in (np.int64, np.float64, np.int8):
        for n in (1, 6):
            x = inp(r, n * p, dtype)
            pairs = []
            # Allreduce (small path; 2 ranks: one exchange)
            a, b = np.empty_like(x), np.empty((n * p, 2), dtype, order="F")
            await comm.Allreduce(x, a)
            await comm.Allreduce(np.asfortranarray(np.stack([x, x], 1)), b)
            pairs.append(("allreduce", a, b[:, 0]))
            # Bcast
            a = x.copy() if r == 0 else np.zeros_like(x)
            b = np.asfortranarray(np.stack([a, a], 1))
            await comm.Bcast(a, 1 % p)
            await comm.Bcast(b, 1 % p)
            pairs.append(("bcast", a, b[:, 0]))
            # Allgather
            blk = x[:n].copy()
            a = np.empty(n * p, dtype)
            b = np.empty((n * p, 2), dtype, order="F")
            await comm.Allgather(blk, a)
            await comm.Allgather(np.asfortranarray(np.stack([blk, blk], 1)), b)
            want = np.concatenate([inp(q, n * p, dtype)[:n] for q in range(p)])
            check(a, want, ("allgather small", dtype, n))
            # Alltoall
            a = np.empty_like(x)
            await comm.Alltoall(x, a)
            want = np.concatenate([inp(q, n * p, dtype)[r * n:(r + 1) * n] for q in range(p)])
            check(a, want, ("alltoall small", dtype, n))
            # Reduce_scatter_block
            a = np.empty(n, dtype)
            await comm.Reduce_scatter_block(x, a)
            want = reference(ucxcomm.SUM, [inp(q, n * p, dtype)[r * n:(r + 1) * n]
                                           for q in range(p)])
            check(a, want, ("reduce_scatter_block small", dtype, n))
            for what, got, general in pairs:
                assert np.array_equal(got, general), (what, dtype, n, got, general)
            await same_everywhere(comm, pairs[0][1], ("allreduce small", dtype, n))



@case
async def two_rank_compiled_allreduce(comm):
    """Two ranks, small SUM of 32/64-bit numbers: one call into compiled code (exchange
    and reduction). Its results equal numpy's (integers wrap, inf/nan propagate), bit
    for bit on both ranks, for shapes, IN_PLACE and every such dtype; a call whose peer
    is late finishes through the awaitable; and a rank whose arguments the compiled
    path does not serve (an unaligned view: the Python path) interoperates with a peer
    that took it (same messages and tags)."""
    assert comm.size == 2
    r = comm.rank
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64):
        info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else np.finfo(dtype)
        for shape in ((1,), (5,), (3, 4)):
            mine = inp(r, int(np.prod(shape)), dtype).reshape(shape)
            theirs = inp(1 - r, int(np.prod(shape)), dtype).reshape(shape)
            mine.flat[0] = info.max  # wraps (integers) or overflows to inf (floats)
            theirs.flat[0] = info.max
            if np.dtype(dtype).kind == "f":
                (mine if r == 0 else theirs).flat[-1] = np.nan
            with np.errstate(over="ignore"):
                want = (mine + theirs) if r == 0 else (theirs + mine)
            out = np.empty_like(mine)
            await comm.Allreduce(mine, out)
            assert np.array_equal(out, want, equal_nan=True), (dtype, shape, out, want)
            await same_everywhere(comm, out, ("compiled", dtype, shape))
            buf = mine.copy()
            await comm.Allreduce(IN_PLACE, buf)
            assert np.array_equal(buf, want, equal_nan=True), (dtype, shape, "in place")
    assert type(comm._fast).__name__ == "FastCollectives", comm._fast
    # The peer is late: this rank's call waits (its awaitable finishes the call).
    for late in (0, 1):
        if r == late:
            await asyncio.sleep(0.2)
        out = np.empty(4, np.float64)
        await comm.Allreduce(np.full(4, r + 1.0), out)
        assert (out == 3.0).all(), (late, out)
    # Rank 0's buffers are unaligned views (the Python path), rank 1's are not.
    for _ in range(3):
        if r == 0:
            raw = np.zeros(8 * 4 + 1, np.uint8)
            send = raw[1:].view(np.float64)
            out = np.zeros(8 * 4 + 1, np.uint8)[1:].view(np.float64)
            send[:] = 1.5
        else:
            send, out = np.full(4, 2.0), np.empty(4)
        await comm.Allreduce(send, out)
        assert (out == 3.5).all(), (r, out)
    # Many in a row, then a different op and dtype on the same communicator.
    acc = np.zeros(1, np.int64)
    for i in range(2000):
        await comm.Allreduce(np.array([i + r], np.int64), acc)
        assert acc[0] == 2 * i + 1, (i, acc)
    await comm.Allreduce(np.array([r], np.int16), res := np.empty(1, np.int16), ucxcomm.MAX)
    assert res[0] == 1



@case
async def two_rank_compiled_others(comm):
    """Two ranks: Bcast, Allgather, Alltoall and Reduce_scatter_block of small host
    arrays are one compiled call each. Results against numpy for several dtypes (any
    plain dtype for the copies, SUM of 32/64-bit numbers for the reduction), with a
    late peer (the awaitable finishes the call), and against a peer whose arguments
    take the Python path (Fortran order: same messages and tags)."""
    assert comm.size == 2
    r = comm.rank
    for dtype in (np.float32, np.int64, np.int8, np.complex128):
        for n in (1, 6):
            for late in (None, 0, 1):
                if r == late:
                    await asyncio.sleep(0.1)
                x = inp(r, 2 * n, dtype)
                # Bcast from each root
                for root in (0, 1):
                    b = x.copy() if r == root else np.zeros_like(x)
                    await comm.Bcast(b, root)
                    check(b, inp(root, 2 * n, dtype), ("bcast", dtype, n, late, root))
                # Allgather
                out = np.empty(2 * n, dtype)
                await comm.Allgather(x[:n].copy(), out)
                check(out, np.concatenate([inp(q, 2 * n, dtype)[:n] for q in (0, 1)]),
                      ("allgather", dtype, n, late))
                # Alltoall
                out = np.empty(2 * n, dtype)
                await comm.Alltoall(x, out)
                want = np.concatenate([inp(q, 2 * n, dtype)[r * n:(r + 1) * n]
                                       for q in (0, 1)])
                check(out, want, ("alltoall", dtype, n, late))
                # Reduce_scatter_block (recv longer than a block: the result is its start)
                out = np.full(n + 1, 7, dtype)
                await comm.Reduce_scatter_block(x, out)
                want = reference(ucxcomm.SUM, [inp(q, 2 * n, dtype)[r * n:(r + 1) * n]
                                               for q in (0, 1)])
                check(out[:n], want, ("reduce_scatter_block", dtype, n, late))
                assert out[n] == 7, ("reduce_scatter_block wrote past its block", out)
    assert type(comm._fast).__name__ == "FastCollectives", comm._fast
    # Rank 0 passes Fortran-ordered 2-D arrays (the general path), rank 1 flat ones.
    def shaped(a):
        return np.asfortranarray(a.reshape(2, -1)) if r == 0 else a

    b = shaped(inp(1, 4, np.float64) if r == 1 else np.zeros(4))
    await comm.Bcast(b, 1)
    check(np.ravel(b, order="K"), inp(1, 4, np.float64), "mixed bcast")
    out = shaped(np.zeros(8))
    await comm.Allgather(inp(r, 4, np.float64), out)
    check(np.ravel(out, order="K"), np.concatenate([inp(q, 4, np.float64) for q in (0, 1)]),
          "mixed allgather")


@case
async def closed_two_rank_allreduce(comm):
    """After close, a two-rank Allreduce raises ClosedError at once, on a communicator
    whose compiled path already ran and on one where it never did."""
    assert comm.size == 2
    used = await comm.dup()
    unused = await comm.dup()
    out = np.empty(1)
    await used.Allreduce(np.ones(1), out)
    assert out[0] == 2.0
    for sub in (used, unused):
        await sub.close()
        try:
            await asyncio.wait_for(sub.Allreduce(np.ones(1), out), 10)
        except ucxcomm.ClosedError:
            pass
        else:
            raise AssertionError("Allreduce on a closed communicator did not raise")
    await comm.barrier()


@case
async def group_compiled_allreduce(comm):
    """Three or more ranks, small SUM of 32/64-bit numbers: one call into compiled code
    (every input to every rank, folded from the left in rank order in C). Results equal
    that fold bit for bit on every rank (integers wrap, inf/nan propagate), for shapes,
    IN_PLACE and every such dtype; late ranks make the others' calls finish through
    the awaitable; ranks whose arguments take the Python path (unaligned views) mix
    with ranks on the compiled one, and both fold in the same order (numpy's reduce
    would sum 8 or more one-element rows pairwise: 1e16 + seven 1.0 differs)."""
    p, r = comm.size, comm.rank
    assert p > 2
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64):
        info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else np.finfo(dtype)
        for shape in ((1,), (5,), (3, 4)):
            n = int(np.prod(shape))
            rows = [inp(q, n, dtype).reshape(shape) for q in range(p)]
            rows[0].flat[0] = rows[1].flat[0] = info.max  # wraps, or overflows to inf
            if np.dtype(dtype).kind == "f":
                rows[p - 1].flat[-1] = np.nan
            with np.errstate(over="ignore", invalid="ignore"):
                want = reference(ucxcomm.SUM, rows)
            out = np.empty_like(rows[r])
            await comm.Allreduce(rows[r], out)
            assert np.array_equal(out, want, equal_nan=True), (dtype, shape, out, want)
            await same_everywhere(comm, out, ("compiled", dtype, shape))
            buf = rows[r].copy()
            await comm.Allreduce(IN_PLACE, buf)
            assert np.array_equal(buf, want, equal_nan=True), (dtype, shape, "in place")
    assert comm._fast_ar.__self__.__class__.__name__ == "FastCollectives"
    # Late ranks: the others wait (their awaitables finish the calls).
    for late in (0, p - 1):
        if r == late:
            await asyncio.sleep(0.2)
        out = np.empty(4, np.float64)
        await comm.Allreduce(np.full(4, r + 1.0), out)
        assert (out == p * (p + 1) / 2).all(), (late, out)
    # Order: every other rank on the Python path (unaligned views), the rest compiled.
    for _ in range(3):
        x = 1e16 if r == 0 else 1.0
        if r % 2:
            send = np.zeros(9, np.uint8)[1:].view(np.float64)
            out = np.zeros(9, np.uint8)[1:].view(np.float64)
            send[0] = x
        else:
            send, out = np.array([x]), np.empty(1)
        await comm.Allreduce(send, out)
        want = np.float64(1e16)
        for _ in range(p - 1):
            want = want + np.float64(1.0)
        assert out[0] == want, (r, out[0] - 1e16, want - 1e16)
        await same_everywhere(comm, out, "mixed paths")
    # Many in a row, then another op and dtype (the Python path) on the same communicator.
    acc = np.zeros(1, np.int64)
    for i in range(500):
        await comm.Allreduce(np.array([i + r], np.int64), acc)
        assert acc[0] == p * i + p * (p - 1) // 2, (i, acc)
    await comm.Allreduce(np.array([r], np.int16), res := np.empty(1, np.int16), ucxcomm.MAX)
    assert res[0] == p - 1


@case
async def group_compiled_others(comm):
    """Three or more ranks: Bcast, Allgather, Alltoall and Reduce_scatter_block of small
    host arrays are one compiled call each. Results against numpy for several dtypes,
    with late ranks (the awaitables finish the calls), and with ranks whose arguments
    take the Python path (unaligned views) mixed in: same messages and tags, and the
    same fold order for Reduce_scatter_block (1e16 + 1.0 + ... bit for bit)."""
    p, r = comm.size, comm.rank
    assert p > 2
    for dtype in (np.float32, np.int64, np.int8, np.complex128):
        for n in (1, 6):
            for late in (None, 0, p - 1):
                if r == late:
                    await asyncio.sleep(0.1)
                x = inp(r, p * n, dtype)
                for root in (0, p - 1):
                    b = x.copy() if r == root else np.zeros_like(x)
                    await comm.Bcast(b, root)
                    check(b, inp(root, p * n, dtype), ("bcast", dtype, n, late, root))
                out = np.empty(p * n, dtype)
                await comm.Allgather(x[:n].copy(), out)
                check(out, np.concatenate([inp(q, p * n, dtype)[:n] for q in range(p)]),
                      ("allgather", dtype, n, late))
                out = np.empty(p * n, dtype)
                await comm.Alltoall(x, out)
                want = np.concatenate([inp(q, p * n, dtype)[r * n:(r + 1) * n]
                                       for q in range(p)])
                check(out, want, ("alltoall", dtype, n, late))
                out = np.full(n + 1, 7, dtype)
                await comm.Reduce_scatter_block(x, out)
                want = reference(ucxcomm.SUM, [inp(q, p * n, dtype)[r * n:(r + 1) * n]
                                               for q in range(p)])
                check(out[:n], want, ("reduce_scatter_block", dtype, n, late))
                assert out[n] == 7, ("reduce_scatter_block wrote past its block", out)
    assert type(comm._fast).__name__ == "FastCollectives", comm._fast

    def unaligned(n):  # a float64 view one byte off: the Python path
        return np.zeros(8 * n + 1, np.uint8)[1:].view(np.float64)

    for _ in range(2):
        odd = r % 2 == 1
        b = unaligned(3) if odd else np.zeros(3)
        if r == 1:
            b[:] = inp(1, 3, np.float64)
        await comm.Bcast(b, 1)
        check(b, inp(1, 3, np.float64), "mixed bcast")
        out = unaligned(p) if odd else np.zeros(p)
        await comm.Allgather(np.array([float(r)]), out)
        check(out, np.arange(p, dtype=np.float64), "mixed allgather")
        send = unaligned(p) if odd else np.zeros(p)
        send[:] = 1e16 if r == 0 else 1.0
        out = unaligned(1) if odd else np.zeros(1)
        await comm.Reduce_scatter_block(send, out)
        want = np.float64(1e16)
        for _ in range(p - 1):
            want = want + np.float64(1.0)
        assert out[0] == want, ("mixed reduce_scatter_block", r, out[0] - 1e16)
        await same_everywhere(comm, out, "mixed reduce_scatter_block")




@case
async def every_collective_takes_a_timeout(comm):
    """Every blocking collective (and split/dup) takes ``timeout=``: with time to spare
    they complete as without; a bad value fails at the call, before any I/O."""
    p, r = comm.size, comm.rank
    sub = await comm.dup(timeout=30)
    t = 30
    x = np.arange(4, dtype=np.float64) + r
    out = np.zeros(4)
    await sub.Bcast(out, root=0, timeout=t)
    await sub.Reduce(x, out if r == 0 else None, root=0, timeout=t)
    await sub.Allreduce(x, out, timeout=t)
    assert (out == sum(np.arange(4.0) + q for q in range(p))).all()
    g = np.zeros(4 * p)
    await sub.Gather(x, g if r == 0 else None, root=0, timeout=t)
    await sub.Gatherv(x, (g, [4] * p) if r == 0 else None, root=0, timeout=t)
    await sub.Scatter(g if r == 0 else None, out, root=0, timeout=t)
    await sub.Scatterv((g, [4] * p) if r == 0 else None, out, root=0, timeout=t)
    await sub.Allgather(x, g, timeout=t)
    await sub.Allgatherv(x, (g, [4] * p), timeout=t)
    await sub.Alltoall(g, np.zeros(4 * p), timeout=t)
    await sub.Alltoallv((g, [4] * p), (np.zeros(4 * p), [4] * p), timeout=t)
    await sub.Reduce_scatter_block(g, out, timeout=t)
    await sub.Reduce_scatter(g, out, [4] * p, timeout=t)
    await sub.Scan(x, out, timeout=t)
    await sub.Exscan(x, out, timeout=t)
    await sub.barrier(timeout=t)
    assert await sub.bcast("b", root=0, timeout=t) == "b"
    assert await sub.reduce(1, root=0, timeout=t) == (p if r == 0 else None)
    assert await sub.allreduce(1, timeout=t) == p
    assert await sub.gather(r, root=0, timeout=t) == (list(range(p)) if r == 0 else None)
    assert await sub.allgather(r, timeout=t) == list(range(p))
    assert await sub.scatter(list(range(p)) if r == 0 else None, root=0, timeout=t) == r
    assert await sub.alltoall([r] * p, timeout=t) == list(range(p))
    assert await sub.scan(1, timeout=t) == r + 1
    assert await sub.exscan(1, timeout=t) == (None if r == 0 else r)
    sub2 = await sub.split(r % 2, timeout=t)
    assert sub2 is not None and sub2.size == len(range(r % 2, p, 2))
    for bad, exc in ((-1, ValueError), (float("nan"), ValueError), ("1", TypeError)):
        for call in (lambda t: sub.Allreduce(x, out, timeout=t),
                     lambda t: sub.bcast(1, timeout=t), lambda t: sub.dup(timeout=t)):
            await refuses_timeout(call, bad, exc)
    # (nothing was posted by those: the next collective still lines up)
    assert await sub.allreduce(r, timeout=t) == sum(range(p))
    await sub2.close()
    await sub.close()


@case
async def collective_timeout_leaves_the_communicator_out_of_step(comm):
    """A rank whose collective times out (its peer never joins) gets CommTimeoutError at
    the deadline; that communicator then refuses every further collective with a clear
    error, at the call, while point-to-point on it still works (2 ranks)."""
    assert comm.size == 2
    sub = await comm.dup()
    if comm.rank == 0:
        out = np.full(4, -1.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await sub.Allreduce(np.ones(4), out, timeout=0.3)
        except ucxcomm.CommTimeoutError as exc:
            assert "no further collective" in str(exc), exc
        else:
            raise AssertionError("the Allreduce completed without its peer")
        assert 0.25 < loop.time() - t0 < 10
        for call in (lambda: sub.Bcast(out), lambda: sub.barrier(timeout=5),
                     lambda: sub.allgather(1), lambda: sub.dup()):
            try:
                await call()
            except ucxcomm.UcxCommError as exc:
                assert "out of step" in str(exc), exc
                assert not isinstance(exc, ucxcomm.CommTimeoutError)
            else:
                raise AssertionError("a collective ran on an out-of-step communicator")
        try:
            sub.Iallreduce(np.ones(4), out)
        except ucxcomm.UcxCommError as exc:
            assert "out of step" in str(exc), exc
        else:
            raise AssertionError("Iallreduce accepted")
        await sub.send("p2p still works", 1)
        assert await sub.recv(1) == "ack"
        assert (out == -1.0).all(), out  # (the abandoned receive never wrote it)
    else:
        assert await sub.recv(0) == "p2p still works"
        await sub.send("ack", 0)
    sub.abort()
    await comm.barrier()


@case
async def window_timeouts_and_async_with(comm):
    """Windows: ``async with`` frees them; every blocking call takes ``timeout=``; a Lock
    that cannot be had gives up at its deadline without leaving the lock taken."""
    p, r = comm.size, comm.rank
    async with await ucxcomm.Win.Allocate(comm, 64, timeout=30) as win:
        await win.Put(np.full(8, r, np.uint8), (r + 1) % p, 0, timeout=30)
        await win.Flush((r + 1) % p, timeout=30)
        await win.Fence(timeout=30)
        assert (win.memory[:8] == (r - 1) % p).all()
        got = np.zeros(8, np.uint8)
        await win.Get(got, (r + 1) % p, 0, timeout=30)
        assert (got == r).all()
        await win.Accumulate(np.ones(1, np.int64), 0, 8, timeout=30)
        await win.Accumulate(np.ones(1, np.float64), 0, 16, timeout=30)  # (locked path)
        await win.Fetch_and_op(1, 0, 24, timeout=30)
        await win.Compare_and_swap(5, 0, 0, 32, timeout=30)
        await win.Flush_all(timeout=30)
        await win.Lock_all(timeout=30)
        await win.Unlock_all(timeout=30)
        await win.Fence(timeout=30)
        if r == 0:
            assert win.memory[8:16].view(np.int64)[0] == p
        if p >= 2:
            if r == 0:
                await win.Lock(1, exclusive=True, timeout=30)
            await comm.barrier()
            if r == p - 1 and r != 0:
                try:
                    await win.Lock(1, exclusive=True, timeout=0.3)
                except ucxcomm.CommTimeoutError:
                    pass
                else:
                    raise AssertionError("an exclusive lock was taken twice")
            await comm.barrier()
            if r == 0:
                await win.Unlock(1, timeout=30)
            await comm.barrier()
            if r == p - 1 and r != 0:  # (the failed attempt left nothing taken)
                await win.Lock(1, exclusive=True, timeout=30)
                await win.Unlock(1, timeout=30)
            await comm.barrier()
        for bad in (-1, float("inf")):
            try:
                await win.Put(np.zeros(1, np.uint8), 0, timeout=bad)
            except ValueError:
                pass
            else:
                raise AssertionError("timeout accepted")
    assert win.closed
    try:
        async with await ucxcomm.Win.Allocate(comm, 8) as win2:
            raise KeyError("inside")
    except KeyError:
        pass
    assert win2.closed  # (released at once when the block raised)
    await comm.barrier()



class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


class _BadOnLoad:
    """Pickles fine; unpickling it raises (on whichever rank receives it)."""

    def __reduce__(self):
        return (_refuse_load, ())


def _refuse_load():
    raise ValueError("this object refuses to be unpickled")


@case
async def object_collective_failures_reach_every_rank(comm):
    """An object collective that fails on one rank (its op raises, its object does not
    pickle or unpickle) fails on every rank whose result depends on it, naming that rank
    and the cause, within the deadline: none waits for data that never comes (before:
    allreduce with a raising op left rank 1 waiting forever, allgather of an
    unpicklable object left the others waiting). The communicator stays usable."""
    r, p = comm.rank, comm.size
    assert p > 1  # (one rank pickles nothing and combines nothing)

    async def expect(coro, own, failing, *, others=True):
        """``coro`` raises ``own`` on rank ``failing``, CollectiveError naming it on the
        others (when ``others``; else they may return), within 20 s."""
        try:
            got = await asyncio.wait_for(coro, 20)
        except ucxcomm.CollectiveError as exc:
            assert r != failing, exc
            assert exc.rank == failing and f"rank {failing}" in str(exc), exc
            return exc
        except own as exc:
            assert r == failing, exc
            return exc
        assert r != failing and not others, (r, got)
        return got

    # The op raises where it combines: rank 0 (the root of the fold).
    await expect(comm.allreduce(r + 1, op=lambda a, b: a / 0 if r == 0 else a + b),
                 ZeroDivisionError, 0)
    assert await comm.allreduce(r + 1) == p * (p + 1) // 2  # (usable afterwards)
    res = await expect(comm.reduce(r, op=lambda a, b: a // 0 if r == 0 else a + b),
                       ZeroDivisionError, 0, others=False)
    assert r == 0 or res is None, res
    # An object that does not pickle (the last rank's).
    bad = p - 1
    await expect(comm.allgather(_Unpicklable() if r == bad else r), TypeError, bad)
    await expect(comm.bcast(_Unpicklable() if r == bad else None, root=bad), TypeError, bad)
    await expect(comm.scatter([_Unpicklable()] * p if r == bad else None, root=bad),
                 TypeError, bad)
    res = await expect(comm.gather(_Unpicklable() if r == bad else r, root=0), TypeError,
                       bad, others=False)
    assert r in (0, bad) or res is None, res
    assert r != 0 or isinstance(res, ucxcomm.CollectiveError), res
    # An object that does not unpickle where it arrives: the receivers raise the
    # ValueError, whoever depends on them CollectiveError (naming a receiver).
    try:
        got = await asyncio.wait_for(comm.bcast(_BadOnLoad() if r == 0 else None), 20)
    except ValueError as exc:
        assert r != 0 and "refuses to be unpickled" in str(exc), exc
    except ucxcomm.CollectiveError as exc:
        assert r != 0 and exc.rank not in (0, r), exc
    else:
        assert r == 0 and isinstance(got, _BadOnLoad), got
    assert await comm.allgather(r) == list(range(p))


@case
async def bcast_chain(comm):
    """Bcast's pipelined chain (large messages, 3 ranks or more; run with the node's
    shared-memory engine off, so the general path serves it), forced on with small
    segments: every root, counts that do not divide into segments, byte and float
    dtypes, a read-only root buffer. Then the default switch point and segments, at
    the last rank as root, with the segment count and the ranks' traffic checked:
    each rank sends the message once, except the chain's last, which sends nothing."""
    p, r = comm.size, comm.rank
    assert comm._shm is None or not ucxcomm.settings.get("UCXCOMM_SHM"), "engine on"
    saved = dict(algorithms.TUNING)
    try:
        algorithms.TUNING["bcast_chain_min"] = 0
        algorithms.TUNING["bcast_chain_seg_min"] = 4096
        algorithms.TUNING["segment"] = 4096
        for dtype in (np.uint8, np.float64):
            for n in (1, p + 1, 7919, 3 * 4096 * p + 11):
                for root in range(p):
                    want = inp(root, n, dtype, salt=n)
                    if r == root:
                        buf = want.copy()
                        buf.flags.writeable = False  # the root's buffer is only read
                    else:
                        buf = np.zeros(n, dtype)
                    await comm.Bcast(buf, root=root)
                    check(buf, want, ("bcast chain", np.dtype(dtype).name, n, root))
        algorithms.TUNING.update(saved)
        n = algorithms.TUNING["bcast_chain_min"] // 8 * 3 + 5  # float64: above it
        root = p - 1
        want = inp(root, n, np.float64, salt=1)
        buf = want.copy() if r == root else np.zeros(n, np.float64)
        before = sum(_sent(comm.stats()).values())
        await comm.Bcast(buf, root=root)
        sent = sum(_sent(comm.stats()).values()) - before
        check(buf, want, ("bcast chain, default tuning", n, root))
        last = (root - 1) % p
        if r == last:
            assert sent < 4096, ("the chain's last rank sent", sent)
        else:
            assert n * 8 <= sent < n * 8 + 4096, ("sent", sent, "of", n * 8)
    finally:
        algorithms.TUNING.update(saved)


def _sent(stats):
    return {q: v["sent"]["bytes"] for q, v in stats["peers"].items()}


async def _across_hosts(comm, before, labels):
    """The bytes every rank sent to other hosts since ``before`` (its ``_sent``), summed
    over the ranks (collective)."""
    after = _sent(comm.stats())
    mine = sum(after.get(q, 0) - before.get(q, 0) for q in after
               if labels[q] != labels[comm.rank])
    return sum(await comm.allgather(mine))


@case
async def hierarchical_collectives(comm):
    """Ranks on several hosts, some sharing one (``UCXCOMM_TEST_HOSTS``: each rank's
    ``UCXCOMM_HOST_LABEL``): Allreduce, Allgather(v) and Reduce_scatter(_block) from
    ``hier_min`` bytes go through one leader per host. Results against numpy at sizes
    around the switch and odd counts, in place too; then the traffic: a host's leader
    sends across hosts at most what the hosts' ring needs, the other ranks nothing
    (the flat ring sends each rank's share across); and Reduce and Bcast (two phases
    below the chain's size, the chain host by host above) from every root cross between
    hosts hosts - 1 times."""
    p, r = comm.size, comm.rank
    labels = os.environ["UCXCOMM_TEST_HOSTS"].split(",")
    groups = {}
    for q, lab in enumerate(labels):
        groups.setdefault(lab, []).append(q)
    mine = groups[labels[r]]
    leader = mine[0]
    contiguous = all(g == list(range(g[0], g[-1] + 1)) for g in groups.values())
    hmin = algorithms.TUNING["hier_min"]
    for n in (7, hmin // 8 - 1, hmin // 8 + 3, 3 * hmin // 8 * p + 5):
        for dtype, op, ref in ((np.float64, ucxcomm.SUM, np.add), (np.int32, ucxcomm.MAX,
                                                                    np.maximum)):
            ins = [inp(q, n, dtype, salt=n) for q in range(p)]
            want = ins[0].copy()
            for x in ins[1:]:
                want = ref(want, x)
            out = np.zeros(n, dtype)
            await comm.Allreduce(ins[r], out, op)
            check(out, want, ("allreduce", n, np.dtype(dtype).name))
            await same_everywhere(comm, out, ("allreduce", n))
            buf = ins[r].copy()
            await comm.Allreduce(IN_PLACE, buf, op)
            check(buf, want, ("allreduce in place", n))
            full = [inp(q, n * p, dtype, salt=n) for q in range(p)]
            red = full[0].copy()
            for x in full[1:]:
                red = ref(red, x)
            blk = np.zeros(n, dtype)
            await comm.Reduce_scatter_block(full[r], blk, op)
            check(blk, red[r * n:(r + 1) * n], ("reduce_scatter_block", n))
            buf = full[r].copy()
            await comm.Reduce_scatter_block(IN_PLACE, buf, op)
            check(buf[:n], red[r * n:(r + 1) * n], ("reduce_scatter_block in place", n))
        counts = [n + 3 * q for q in range(p)]
        counts[p // 2] = 0  # (a rank with nothing)
        displs = [sum(counts[:q]) for q in range(p)]
        allg = np.zeros(sum(counts), np.float32)
        await comm.Allgatherv(inp(r, counts[r], np.float32, salt=n), (allg, counts, displs))
        for q in range(p):
            check(allg[displs[q]:displs[q] + counts[q]], inp(q, counts[q], np.float32, salt=n),
                  ("allgatherv", n, q))
        whole = np.zeros(n * p, np.uint8)
        whole[r * n:(r + 1) * n] = inp(r, n, np.uint8, salt=1)
        await comm.Allgather(IN_PLACE, whole)
        for q in range(p):
            check(whole[q * n:(q + 1) * n], inp(q, n, np.uint8, salt=1), ("allgather", n, q))
        red = np.zeros(sum(counts), np.int64)
        full = [inp(q, sum(counts), np.int64, salt=n) for q in range(p)]
        out = np.zeros(max(counts[r], 1), np.int64)
        await comm.Reduce_scatter(full[r], out, counts, ucxcomm.SUM)
        check(out[:counts[r]], sum(full)[displs[r]:displs[r] + counts[r]], ("reduce_scatter", n))
    # The traffic of one large call each.
    n = 4 * hmin // 8 * p
    h = len(groups)
    for what in ("Allreduce", "Allgather", "Reduce_scatter_block"):
        if what != "Allreduce" and not contiguous:
            continue  # (hosts' blocks not in one region each: the flat ring)
        x = inp(r, n, np.float64)
        before = _sent(comm.stats())
        if what == "Allreduce":
            await comm.Allreduce(x, np.zeros(n, np.float64))
            share = 2 * (h - 1) * n * 8 // h  # the leaders' ring over h hosts
        elif what == "Allgather":
            await comm.Allgather(x[:n // p], np.zeros(n // p * p, np.float64))
            share = n // p * 8 * p  # at most every other host's blocks
        else:
            await comm.Reduce_scatter_block(x, np.zeros(n // p, np.float64))
            share = (n - min(len(g) for g in groups.values()) * (n // p)) * 8
        after = _sent(comm.stats())
        sent = {q: after.get(q, 0) - before.get(q, 0) for q in after}
        others = sum(v for q, v in sent.items() if labels[q] != labels[r])
        if r != leader:
            assert others < 4096, (what, "across hosts from a non-leader", sent)
        else:
            assert others < share + 4096 * p, (what, "across hosts", others, share)
        await comm.barrier()
    # Reduce, and Bcast below the chain's size (two phases), then the chain Bcast (host
    # by host), from every root: each crosses between hosts h - 1 times.
    for root in range(p):
        n = hmin // 8 + 5
        ins = [inp(q, n, np.float64, salt=root) for q in range(p)]
        out = np.zeros(n, np.float64)
        before = _sent(comm.stats())
        await comm.Reduce(ins[r], out if r == root else None, ucxcomm.SUM, root=root)
        if r == root:
            check(out, sum(ins), ("reduce", root))
        total = await _across_hosts(comm, before, labels)
        assert (h - 1) * n * 8 <= total < (h - 1) * n * 8 + 4096 * p, \
            ("reduce across hosts", root, total, (h - 1) * n * 8)
        buf = ins[r].copy()
        await comm.Reduce(IN_PLACE if r == root else buf, buf if r == root else None,
                          ucxcomm.SUM, root=root)
        if r == root:
            check(buf, sum(ins), ("reduce in place", root))
    for n in (hmin // 8 + 3, algorithms.TUNING["bcast_chain_min"] // 8 + 3):
        for root in range(p):
            want = inp(root, n, np.float64, salt=root)
            buf = want.copy() if r == root else np.zeros(n, np.float64)
            before = _sent(comm.stats())
            await comm.Bcast(buf, root=root)
            check(buf, want, ("bcast", n, root))
            total = await _across_hosts(comm, before, labels)
            assert (h - 1) * n * 8 <= total < (h - 1) * n * 8 + 4096 * p, \
                ("bcast across hosts", n, root, total, (h - 1) * n * 8)


@cases.case
async def alltoall_across_hosts(comm):
    """Alltoall(v) where the ranks span hosts (``UCXCOMM_TEST_HOSTS``): blocks within
    ``alltoall_pairs_min``/``max`` take the pairwise steps (counted here, with the peers
    of each step in posting order: with a power of two ranks, step s exchanges with
    rank ^ s both ways, else it sends to r+s and receives from r-s), the others all at
    once; results against numpy, in place too, and an Alltoallv whose ranks choose
    differently (one rank's largest block in the range, the others' below)."""
    p, r = comm.size, comm.rank
    t = algorithms.TUNING
    lo, hi = t["alltoall_pairs_min"], t["alltoall_pairs_max"]
    calls = []
    pairs = algorithms._alltoallv_pairs
    chan_send, chan_recv = algorithms.Chan.send, algorithms.Chan.recv
    log: list | None = None

    def send(self, q, b):
        if log is not None:
            log.append(("send", q))
        return chan_send(self, q, b)

    def recv(self, q, b):
        if log is not None:
            log.append(("recv", q))
        return chan_recv(self, q, b)

    if p & (p - 1) == 0:
        want = [(k, r ^ s) for s in range(1, p) for k in ("recv", "send")]
    else:
        want = [(k, (r - s if k == "recv" else r + s) % p) for s in range(1, p)
                for k in ("recv", "send")]

    async def counted(*args):
        nonlocal log
        calls.append(args[1])
        log = []
        try:
            await pairs(*args)
            assert log == want, ("pairwise steps' peers", log, want)
        finally:
            log = None

    algorithms._alltoallv_pairs = counted
    algorithms.Chan.send, algorithms.Chan.recv = send, recv
    try:
        for blk, taken in ((lo // 8 - 1, False), (lo // 8 + 3, True), (hi // 8 - 1, True),
                           (hi // 8, False)):
            before = len(calls)
            send = np.stack([inp(r, blk, np.float64, salt=q) for q in range(p)]).ravel()
            out = np.zeros(blk * p, np.float64)
            await comm.Alltoall(send, out)
            for q in range(p):
                check(out[q * blk:(q + 1) * blk], inp(q, blk, np.float64, salt=r),
                      ("alltoall", blk, q))
            buf = send.copy()
            await comm.Alltoall(IN_PLACE, buf)
            check(buf, out, ("alltoall in place", blk))
            assert (len(calls) - before == 2) == taken, (blk, len(calls) - before)
        # Alltoallv: rank 0 sends blocks in the pairs range, the others smaller ones;
        # rank p - 1 sends nothing to rank 1
        def count(src, dst):
            if src == p - 1 and dst == 1:
                return 0
            return (lo // 8 + 5 + dst) if src == 0 else (3 + src + dst)

        sc = [count(r, d) for d in range(p)]
        rc = [count(q, r) for q in range(p)]
        sd = [sum(sc[:d]) for d in range(p)]
        rd = [sum(rc[:q]) for q in range(p)]
        send = np.concatenate([inp(r, sc[d], np.int64, salt=d) for d in range(p)])
        out = np.zeros(sum(rc), np.int64)
        before = len(calls)
        await comm.Alltoallv((send, sc, sd), (out, rc, rd))
        for q in range(p):
            check(out[rd[q]:rd[q] + rc[q]], inp(q, rc[q], np.int64, salt=r), ("alltoallv", q))
        assert (len(calls) - before == 1) == (r == 0), (r, len(calls) - before)
    finally:
        algorithms._alltoallv_pairs = pairs
        algorithms.Chan.send, algorithms.Chan.recv = chan_send, chan_recv


@cases.case
async def bcast_across_hosts(comm):
    """Every rank on a host of its own (``UCXCOMM_TEST_HOSTS``): Bcast from
    ``bcast_chain_min_hosts`` bytes is the chain (below it the binomial tree), from every
    root, odd sizes; each rank sends the message at most once, the chain's last none
    (the tree's root sends it to each of its children)."""
    p, r = comm.size, comm.rank
    lo = algorithms.TUNING["bcast_chain_min_hosts"]
    for n, chain in ((lo // 8 - 1, False), (lo // 8 + 3, True), (5 * lo // 8 + 7, True)):
        for root in range(p):
            want = inp(root, n, np.float64, salt=root)
            buf = want.copy() if r == root else np.zeros(n, np.float64)
            before = sum(_sent(comm.stats()).values())
            await comm.Bcast(buf, root=root)
            sent = sum(_sent(comm.stats()).values()) - before
            check(buf, want, ("bcast across hosts", n, root))
            if chain:
                cap = 4096 if r == (root - 1) % p else n * 8 + 4096
                assert sent < cap, ("bcast chain sent", n, root, sent, cap)
            elif r == root:
                assert sent >= 2 * n * 8, ("the tree's root sent", n, sent)
            await comm.barrier()


if __name__ == "__main__":
    if os.environ.get("UCXCOMM_TEST_HOSTS"):  # (before init: each rank's own host label)
        os.environ["UCXCOMM_HOST_LABEL"] = \
            os.environ["UCXCOMM_TEST_HOSTS"].split(",")[int(os.environ["UCXCOMM_RANK"])]
    cases.main()

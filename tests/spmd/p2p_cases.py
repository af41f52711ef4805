"""SPMD point-to-point cases: the same coroutine runs on every rank (``ucxcomm run``).

Run one case: ``ucxcomm run -n 3 python tests/spmd/p2p_cases.py NAME``. Each rank prints
``CASE-OK NAME rank R`` when its assertions passed; tests/test_p2p.py checks the exit
code and that every rank printed it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
import weakref

import numpy as np

import ucxcomm
from ucxcomm import ANY_SOURCE, ANY_TAG
from ucxcomm.testing import Cases, refuses_timeout

cases = Cases(check_init_idempotent=True, collect_garbage=True)
case = cases.case


# Buffer kinds x dtypes x sizes (0, small/eager, around the 8 KiB rendezvous threshold,
# large/rendezvous with an odd size).
DTYPES = [np.uint8, np.int32, np.int64, np.float32, np.float64, np.complex128]
SIZES = [0, 1, 7, 8191, 8193, (1 << 20) + 3]


def make(n, dtype, seed):
    return (np.arange(n, dtype=np.int64) * 7 + seed).astype(dtype)


@case
async def ring_objects(comm):
    """Objects around the ring, including arrays sent out of band (zero-copy receive)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    payload = {"rank": comm.rank, "list": list(range(comm.rank + 3)), "s": "x" * 100,
               "arr": np.full(1 << 20, comm.rank, dtype=np.float64),
               "small": np.arange(5, dtype=np.int16)}
    req = comm.isend(payload, right, tag=11)
    got, status = await comm.recv(left, 11, return_status=True)
    await req
    assert got["rank"] == left and got["list"] == list(range(left + 3)), got
    assert got["s"] == "x" * 100
    assert got["arr"].dtype == np.float64 and got["arr"].shape == (1 << 20,)
    assert (got["arr"] == left).all()
    assert got["arr"].flags.writeable
    # Out of band: the array's memory is the receive buffer itself, not a pickle copy.
    assert got["arr"].base is not None
    assert np.array_equal(got["small"], np.arange(5, dtype=np.int16))
    assert status.source == left and status.tag == 11
    assert status.nbytes >= (1 << 20) * 8, status
    # sendrecv
    back = await comm.sendrecv(("hi", comm.rank), dest=left, source=right, sendtag=3, recvtag=3)
    assert back == ("hi", right)


@case
async def buffers_all_kinds(comm):
    """Send/Recv over dtypes, sizes and buffer kinds, straight into the receive buffer."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    tag = 0
    for dtype in DTYPES:
        for n in SIZES:
            tag += 1
            src = make(n, dtype, comm.rank)
            dst = np.full(n, 99, dtype=dtype)
            req = comm.Isend(src, right, tag)
            status = await comm.Recv(dst, left, tag)
            await req
            assert np.array_equal(dst, make(n, dtype, left)), (dtype, n)
            assert status.source == left and status.tag == tag
            assert status.nbytes == dst.nbytes and status.count(dtype) == n
    # Other buffer kinds: bytearray, memoryview, bytes (send only), F-ordered 2-D array.
    data = bytes(range(256)) * 40
    req = comm.Isend(data, right, 500)
    ba = bytearray(len(data))
    await comm.Recv(ba, left, 500)
    await req
    assert bytes(ba) == data
    mv = memoryview(bytearray(len(data)))
    req = comm.Isend(memoryview(data), right, 501)
    await comm.Recv(mv, left, 501)
    await req
    assert mv.tobytes() == data
    f_src = np.asfortranarray(make(12, np.float64, comm.rank).reshape(3, 4))
    f_dst = np.asfortranarray(np.zeros((3, 4)))
    req = comm.Isend(f_src, right, 502)
    await comm.Recv(f_dst, left, 502)
    await req
    assert np.array_equal(f_dst, np.asfortranarray(make(12, np.float64, left).reshape(3, 4)))


@case
async def nonblocking_waitall(comm):
    """Many Isend/Irecv pairs with every peer, completed with Request.waitall."""
    reqs, bufs = [], {}
    for peer in range(comm.size):
        buf = np.empty(1000, dtype=np.int64)
        bufs[peer] = buf
        reqs.append(comm.Irecv(buf, peer, tag=7))
    sends = [comm.Isend(np.full(1000, comm.rank * 10 + peer, np.int64), peer, tag=7)
             for peer in range(comm.size)]
    statuses = await ucxcomm.Request.waitall(reqs)
    await ucxcomm.Request.waitall(sends)
    for peer, st in zip(range(comm.size), statuses, strict=True):
        assert st.source == peer and st.nbytes == 8000
        assert (bufs[peer] == peer * 10 + comm.rank).all()
    # test() on a finished request, and the object forms
    r = comm.irecv(comm.rank, tag=8)
    s = comm.isend({"me": comm.rank}, comm.rank, tag=8)
    assert await r == {"me": comm.rank}
    await s
    assert r.test() == (True, {"me": comm.rank})


@case
async def any_source_fan_in(comm):
    """Every rank sends to rank 0; ANY_SOURCE/ANY_TAG receives report who sent what."""
    rounds = 20
    if comm.rank != 0:
        for i in range(rounds):
            await comm.send((comm.rank, i), 0, tag=100 + comm.rank)
        return
    seen = {r: [] for r in range(1, comm.size)}
    for _ in range(rounds * (comm.size - 1)):
        (src, i), status = await comm.recv(ANY_SOURCE, ANY_TAG, return_status=True)
        assert status.source == src and status.tag == 100 + src
        seen[src].append(i)
    for src, order in seen.items():
        assert order == list(range(rounds)), (src, order)  # non-overtaking per sender


@case
async def ordering_many_in_flight(comm):
    """1500 in-flight messages per pair arrive in order (same tag, and with ANY_TAG)."""
    n = 1500
    if comm.size == 1:
        peer = 0
    else:
        peer = comm.rank ^ 1
        if peer >= comm.size:  # odd world: the last rank talks to itself
            peer = comm.rank
    recvs = [comm.Irecv(np.empty(1, np.int64), peer, tag=5) for _ in range(n)]
    bufs = []
    sends = []
    for i in range(n):
        b = np.array([i], np.int64)
        bufs.append(b)
        sends.append(comm.Isend(b, peer, tag=5))
    # Irecv requests resolve to statuses; re-read the buffers they were given.
    statuses = await ucxcomm.Request.waitall(recvs)
    await ucxcomm.Request.waitall(sends)
    assert all(st.source == peer for st in statuses)
    # Re-run with objects and ANY_TAG to check order through the matched-probe path.
    sends = [comm.isend(i, peer, tag=i % 7) for i in range(n)]
    got = [await comm.recv(peer, ANY_TAG) for _ in range(n)]
    await ucxcomm.Request.waitall(sends)
    assert got == list(range(n)), got[:20]
    # And buffer order, checked by content.
    outs = [np.empty(1, np.int64) for _ in range(n)]
    recvs = [comm.Irecv(o, peer, tag=9) for o in outs]
    sends = [comm.Isend(np.array([i], np.int64), peer, tag=9) for i in range(n)]
    await ucxcomm.Request.waitall(recvs + sends)
    assert [int(o[0]) for o in outs] == list(range(n))


@case
async def self_messages(comm):
    """A rank can message itself (objects and buffers, blocking-style with Isend first)."""
    req = comm.isend({"x": 1}, comm.rank, tag=1)
    assert await comm.recv(comm.rank, 1) == {"x": 1}
    await req
    src = np.arange(100000, dtype=np.float32)
    dst = np.empty_like(src)
    req = comm.Isend(src, comm.rank, 2)
    await comm.Recv(dst, comm.rank, 2)
    await req
    assert np.array_equal(src, dst)


@case
async def truncation(comm):
    """A too-large message raises TruncationError; the message is consumed and the buffer
    holds its prefix; the next message is unaffected."""
    peer = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    for n in (100, 100000):
        big = np.arange(n, dtype=np.int32)
        r1 = comm.Isend(big, peer, tag=1)
        r2 = comm.Isend(np.array([42], np.int32), peer, tag=1)
        small = np.zeros(10, dtype=np.int32)
        try:
            await comm.Recv(small, left, 1)
        except ucxcomm.TruncationError as exc:
            assert exc.nbytes == n * 4 and exc.capacity == 40, (exc.nbytes, exc.capacity)
            assert exc.status.source == left
        else:
            raise AssertionError("no TruncationError")
        assert np.array_equal(small, np.arange(10, dtype=np.int32))
        nxt = np.zeros(1, np.int32)
        await comm.Recv(nxt, left, 1)
        assert nxt[0] == 42
        await ucxcomm.Request.waitall([r1, r2])


@case
async def posted_receives(comm):
    """Irecv posted before its message arrives goes to UCX's own matching (issue 10): an
    overflow raises TruncationError with the message's size and leaves the buffer
    unwritten (a split rendezvous's: its prefix); matching order holds against
    receives still waiting in ucxcomm's queue (an object receive posted first gets the
    first message, whichever kind comes after it) and against later ones."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for n in (100, 100000):  # eager, rendezvous
        small = np.zeros(10, np.int32)
        r1 = comm.Irecv(small, left, 5)
        nxt = np.zeros(1, np.int32)
        r2 = comm.Irecv(nxt, left, 5)
        await comm.barrier()  # both posted before anything is sent
        s1 = comm.Isend(np.arange(n, dtype=np.int32), right, 5)
        s2 = comm.Isend(np.array([42], np.int32), right, 5)
        try:
            await r1
        except ucxcomm.TruncationError as exc:
            assert (exc.nbytes, exc.capacity) == (n * 4, 40), (exc.nbytes, exc.capacity)
            assert (exc.status.source, exc.status.tag) == (left, 5), exc.status
        else:
            raise AssertionError("no TruncationError")
        if comm._world.split_min and n * 4 >= comm._world.split_min:
            # (a split rendezvous request landed there: the prefix, as Recv leaves it)
            assert np.array_equal(small, np.arange(10, dtype=np.int32)), small
        else:
            assert not small.any(), small  # consumed, not written
        assert (await r2).nbytes == 4 and nxt[0] == 42
        await ucxcomm.Request.waitall([s1, s2])
    # An object receive (ucxcomm's matched-probe queue) posted before a buffer receive
    # of the same criteria takes the first message.
    obj_req = comm.irecv(left, 11)
    buf = np.zeros(3, np.int64)
    buf_req = comm.Irecv(buf, left, 11)
    any_req = comm.Irecv(np.zeros(3, np.int64), ANY_SOURCE, 12)
    await comm.barrier()
    await comm.send(("first", comm.rank), right, 11)
    await comm.Send(np.full(3, 7, np.int64), right, 11)
    await comm.Send(np.full(3, 8, np.int64), right, 12)
    assert await obj_req == ("first", left)
    assert (await buf_req).source == left and (buf == 7).all(), buf
    assert (await any_req).tag == 12
    # The other way round: a buffer receive posted to UCX first, an object receive after.
    buf[:] = 0
    buf_req = comm.Irecv(buf, left, 13)
    obj_req = comm.irecv(left, 13)
    await comm.barrier()
    await comm.Send(np.full(3, 9, np.int64), right, 13)
    await comm.send("second", right, 13)
    assert (await buf_req).nbytes == 24 and (buf == 9).all(), buf
    assert await obj_req == "second"
    await comm.barrier()


@case
async def irecv_at_the_call(comm):
    """Irecv of a communicator's repeated (source, tag) is one crossing into compiled
    code (issue 10): messages already here finish at the call, in matching order, with
    their Status; one that outgrew its buffer raises TruncationError, the prefix
    written; bad buffers still fail at the call with the clear errors."""
    if comm.size < 2:
        return
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    warm = np.zeros(4, np.int32)  # (source, tag) now in the communicator's cache
    req = comm.Irecv(warm, left, 21)
    await comm.Send(np.arange(4, dtype=np.int32), right, 21)
    assert (await req).nbytes == 16 and (warm == np.arange(4)).all(), warm
    ro = np.zeros(4, np.int32)
    ro.flags.writeable = False
    for exc, bad in ((ValueError, np.zeros((4, 4), np.int32)[:, ::2]), (ValueError, ro),
                     (TypeError, 12345)):
        try:
            comm.Irecv(bad, left, 21)
        except exc:
            pass
        else:
            raise AssertionError(f"Irecv({bad!r}) did not raise {exc.__name__}")
    n = 32
    sends = [comm.Isend(np.full(i + 1, i, np.int32), right, 21) for i in range(n)]
    sends.append(comm.Isend(np.arange(100, dtype=np.int32), right, 21))
    await ucxcomm.Request.waitall(sends)
    await comm.barrier()  # every message is here before any receive is posted
    outs = [np.full(n, -1, np.int32) for _ in range(n)]
    reqs = [comm.Irecv(o, left, 21) for o in outs]
    short = np.zeros(10, np.int32)
    trunc = comm.Irecv(short, left, 21)
    assert all(r.done() for r in reqs) and trunc.done()
    for i, (r, o) in enumerate(zip(reqs, outs, strict=True)):
        st = await r
        assert (st.source, st.tag, st.nbytes) == (left, 21, 4 * (i + 1)), st
        assert (o[:i + 1] == i).all() and (o[i + 1:] == -1).all(), (i, o)
    try:
        await trunc
    except ucxcomm.TruncationError as exc:
        assert (exc.nbytes, exc.capacity, exc.status.source) == (400, 40, left), exc
    else:
        raise AssertionError("no TruncationError")
    assert (short == np.arange(10)).all(), short  # the prefix
    # Recv of a cached (source, tag) is one crossing too (waiting in place), with Recv's
    # truncation: the prefix written.
    sends = [comm.Isend(np.full(3, 5, np.int32), right, 21),
             comm.Isend(np.arange(50, dtype=np.int32), right, 21)]
    await ucxcomm.Request.waitall(sends)
    await comm.barrier()
    got = np.zeros(3, np.int32)
    assert await comm.Recv(got, left, 21) == ucxcomm.Status(left, 21, 12)
    assert (got == 5).all(), got
    try:
        await comm.Recv(short, left, 21)
    except ucxcomm.TruncationError as exc:
        assert (exc.nbytes, exc.capacity) == (200, 40), exc
    else:
        raise AssertionError("no TruncationError")
    assert (short == np.arange(10)).all(), short
    await comm.barrier()


@case
async def fast_path(comm):
    """Send/Isend and Recv/Irecv are one compiled call each in the common case (issue 10);
    what that call does not serve takes the checked Python path with the same outcome:
    a peer not connected yet, a (source, tag) never received before, ranks and tags too
    large for C integers, a closed communicator (whose match cache still holds entries)."""
    for f in (comm._send_now, comm._recv_now):
        assert type(f.__self__).__name__ == "P2P", f
    sub = await comm.dup()
    peer = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    got = np.zeros(4, np.int64)
    for i in range(3):  # the first turn connects and caches; the next ones are served
        for tag in (5, 6):
            out = np.arange(4, dtype=np.int64) + 100 * comm.rank + 10 * tag + i
            req = sub.Isend(out, peer, tag)
            st = await sub.Recv(got, left, tag)
            assert (st.source, st.tag, st.nbytes) == (left, tag, 32), st
            assert (got == np.arange(4) + 100 * left + 10 * tag + i).all(), got
            await req
            r = sub.Irecv(got, left, tag)
            await sub.Send(out, peer, tag)
            st = await r
            assert (st.source, st.tag) == (left, tag) and got[0] == 100 * left + 10 * tag + i
    for bad in (lambda: sub.Isend(got, 1 << 70), lambda: sub.Isend(got, peer, 1 << 70),
                lambda: sub.Isend(got, -(1 << 70)), lambda: sub.Irecv(got, 1 << 70),
                lambda: sub.Irecv(got, left, 1 << 70)):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError(f"accepted: {bad}")
    await sub.close()
    for call in (lambda: sub.Isend(got, peer, 5), lambda: sub.Irecv(got, left, 5),
                 lambda: sub.Send(got, peer, 6), lambda: sub.Recv(got, left, 6)):
        try:
            res = call()
            if asyncio.iscoroutine(res):
                await res
        except ucxcomm.ClosedError:
            pass
        else:
            raise AssertionError(f"operation on a closed comm: {call}")
    # The path holds its communicator weakly: a dropped one goes at once, not at the
    # garbage collector's next pass (review: a reference cycle kept it).
    tmp = await comm.dup()
    await tmp.Send(got, comm.rank)  # (its path used once)
    await tmp.Recv(got, comm.rank)
    await tmp.close()
    gc.disable()
    try:
        gone = weakref.ref(tmp)
        del tmp
        assert gone() is None, gc.get_referrers(gone())
    finally:
        gc.enable()
    await comm.barrier()


@case
async def cancellation(comm):
    """Cancelling a pending receive withdraws it: its buffer is never written and the
    message goes to the next receive."""
    peer = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    buf = np.zeros(4, np.int64)
    req = comm.Irecv(buf, left, tag=77)
    assert req.test() == (False, None)
    assert req.cancel() is True
    try:
        await req
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("cancelled request did not raise CancelledError")
    obj_req = comm.irecv(left, tag=78)
    assert obj_req.cancel()
    # A task awaiting Recv, cancelled (here through a timeout).
    try:
        await comm.Recv(buf, left, 79, timeout=0.05)
    except ucxcomm.CommTimeoutError:
        pass
    else:
        raise AssertionError("no CommTimeoutError")
    task = asyncio.ensure_future(comm.recv(left, tag=80))
    await asyncio.sleep(0)  # one loop turn: the task starts and posts its receive
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await comm.barrier()
    # Now the messages: none may land in the withdrawn receives.
    for tag in (77, 79):
        await comm.Send(np.full(4, tag, np.int64), peer, tag)
    await comm.send("seventy-eight", peer, 78)
    await comm.send("eighty", peer, 80)
    got = np.zeros(4, np.int64)
    await comm.Recv(got, left, 77)
    assert (got == 77).all() and (buf == 0).all()
    await comm.Recv(got, left, 79)
    assert (got == 79).all() and (buf == 0).all()
    assert await comm.recv(left, 78) == "seventy-eight"
    assert await comm.recv(left, 80) == "eighty"


@case
async def bad_input(comm):
    """Bad arguments fail at the call, before any I/O: nothing is sent."""
    peer = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    arr = np.arange(16, dtype=np.float64).reshape(4, 4)
    ro = np.zeros(4)
    ro.flags.writeable = False
    checks = [
        (ValueError, lambda: comm.Isend(arr[:, ::2], peer)),  # non-contiguous
        (ValueError, lambda: comm.Irecv(arr[:, ::2], peer)),
        (ValueError, lambda: comm.Irecv(ro, peer)),  # read-only receive buffer
        (ValueError, lambda: comm.Irecv(b"bytes are read-only", peer)),
        (TypeError, lambda: comm.Isend(12345, peer)),  # not a buffer
        (TypeError, lambda: comm.Isend(None, peer)),
        (ValueError, lambda: comm.Isend(arr, comm.size)),  # bad rank
        (ValueError, lambda: comm.Isend(arr, -1)),
        (ValueError, lambda: comm.Irecv(arr, comm.size)),
        (TypeError, lambda: comm.Isend(arr, "1")),
        (TypeError, lambda: comm.Isend(arr, 1.0)),
        (ValueError, lambda: comm.Isend(arr, peer, tag=-1)),  # bad tag
        (ValueError, lambda: comm.Isend(arr, peer, tag=ucxcomm.TAG_UB + 1)),
        (ValueError, lambda: comm.isend("x", peer, tag=-5)),
        (ValueError, lambda: comm.irecv(comm.size + 3)),
        (TypeError, lambda: comm.isend(lambda: None, peer)),  # cannot pickle a lambda
    ]
    for exc_type, call in checks:
        try:
            call()
        except exc_type:
            pass
        except Exception as exc:  # pragma: no cover - shows which check misbehaved
            raise AssertionError(f"expected {exc_type.__name__}, got {exc!r}") from exc
        else:
            raise AssertionError(f"expected {exc_type.__name__} from {call}")
    # Timeouts: negative, NaN, infinite or not a number fail before anything is posted
    # (before, timeout=-1 was accepted: a posted receive then timed out at once).
    small = np.zeros(2)
    timeouts = [
        (ValueError, lambda t: comm.Send(small, peer, timeout=t), -1),
        (ValueError, lambda t: comm.Recv(small, left, timeout=t), -0.5),
        (ValueError, lambda t: comm.send("x", peer, timeout=t), float("nan")),
        (ValueError, lambda t: comm.recv(left, timeout=t), float("inf")),
        (TypeError, lambda t: comm.sendrecv("x", peer, source=left, timeout=t), "1"),
        (ValueError, lambda t: comm.Sendrecv(small, peer, small, left, timeout=t), -1),
        (TypeError, lambda t: comm.probe(left, timeout=t), True),
        (ValueError, lambda t: comm.barrier(timeout=t), -2),
    ]
    for exc_type, call, bad in timeouts:
        await refuses_timeout(call, bad, exc_type)
    try:
        await comm.split(-2)
    except ValueError:
        pass
    else:
        raise AssertionError("split(-2) accepted")
    # Nothing was sent by the failed calls: the first message to arrive is this one.
    await comm.send("first", peer, tag=0)
    msg, status = await comm.recv(left, ANY_TAG, return_status=True)
    assert msg == "first" and status.tag == 0
    assert comm.iprobe(ANY_SOURCE, ANY_TAG) is None


@case
async def probe(comm):
    """probe/iprobe report the next message without consuming it."""
    peer = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    req = comm.Isend(np.arange(300, dtype=np.int16), peer, tag=33)
    status = await comm.probe(left, ANY_TAG)
    assert status.source == left and status.tag == 33 and status.nbytes == 600
    st2 = comm.iprobe(ANY_SOURCE, 33)
    assert st2 is not None and st2.nbytes == 600
    buf = np.empty(status.nbytes // 2, np.int16)
    await comm.Recv(buf, status.source, status.tag)
    assert np.array_equal(buf, np.arange(300, dtype=np.int16))
    await req
    assert comm.iprobe(left, 33) is None
    await comm.barrier()


@case
async def communicators(comm):
    """split/dup: separate message spaces, correct ranks, colour None."""
    dup = await comm.dup()
    assert dup.rank == comm.rank and dup.size == comm.size
    peer = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    # Same tag on both communicators; the receive on `comm` must get comm's message even
    # though dup's message was sent first.
    r1 = dup.isend("on-dup", peer, tag=1)
    await comm.barrier()
    r2 = comm.isend("on-comm", peer, tag=1)
    assert await comm.recv(left, 1) == "on-comm"
    assert await dup.recv(left, 1) == "on-dup"
    await ucxcomm.Request.waitall([r1, r2])
    # split by parity, key reverses the order
    sub = await comm.split(comm.rank % 2, key=-comm.rank)
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert sub.size == len(members)
    assert sub.rank == sorted(members, reverse=True).index(comm.rank)
    ranks = await sub.allgather(comm.rank)
    assert ranks == sorted(members, reverse=True)
    # sub traffic is isolated from comm traffic with the same tag
    if sub.size > 1:
        sp = (sub.rank + 1) % sub.size
        sl = (sub.rank - 1) % sub.size
        req = sub.isend(("sub", comm.rank), sp, tag=2)
        assert (await sub.recv(sl, 2))[0] == "sub"
        await req
    none = await comm.split(None if comm.rank == 0 else 1)
    assert (none is None) == (comm.rank == 0)
    if none is not None:
        assert none.size == comm.size - 1
        await none.barrier()
        await none.close()
    await sub.barrier()
    await sub.close()
    try:
        await sub.send(1, 0)
    except ucxcomm.ClosedError:
        pass
    else:
        raise AssertionError("send on a closed communicator")
    await dup.close()


@case
async def barrier_and_timeouts(comm):
    for _ in range(5):
        await comm.barrier(timeout=30)
    try:
        await comm.recv(ANY_SOURCE, 4242, timeout=0.05)
    except ucxcomm.CommTimeoutError as exc:
        assert isinstance(exc, TimeoutError)
    else:
        raise AssertionError("recv did not time out")
    info = comm.transport_info()
    assert set(info) == set(range(comm.size))
    assert all(lanes for lanes in info.values())


@case
async def send_to_exited_peer(comm):
    """Regression: the first send to a rank that already exited (no earlier traffic, so
    the endpoint is created now) printed 8 ``UCX ERROR`` lines (its shared memory is
    gone) around the error. It raises PeerFailure naming the rank, quietly. Rank 1 hands
    its pid over a FIFO (not UCX) and exits; rank 0 waits on a pidfd for the exit, then
    sends at once, before its event loop can hear of the death from the store."""
    import select

    fifo = os.environ["UCXCOMM_TEST_FIFO"]
    if comm.rank == 1:
        wfd = os.open(fifo, os.O_WRONLY)  # (blocks until rank 0 opens it: intended)
        os.write(wfd, f"{os.getpid()}\n".encode())
        os.close(wfd)
        sys.stdout.write("CASE-OK send_to_exited_peer rank 1\n")
        sys.stdout.flush()
        os._exit(0)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        text = b""
        while not text.endswith(b"\n") and len(text) < 16:
            if not select.select([fd], [], [], 30)[0]:
                raise AssertionError("no pid from rank 1")
            chunk = os.read(fd, 16)
            if not chunk:
                break
            text += chunk
    finally:
        os.close(fd)
    pidfd = os.pidfd_open(int(text))
    try:
        assert select.select([pidfd], [], [], 30)[0], "rank 1 did not exit"
    finally:
        os.close(pidfd)
    try:
        await comm.Send(np.zeros(8), 1)
    except ucxcomm.PeerFailure as exc:
        assert exc.peer == 1, exc.peer
    else:
        raise AssertionError("a send to an exited rank succeeded")
    comm.abort()
    return "aborted"


@case
async def peer_failure(comm):
    """The last rank dies (no close); pending and new operations on it raise PeerFailure."""
    victim = comm.size - 1
    await comm.barrier()
    if comm.rank == victim:
        sys.stdout.write(f"CASE-OK peer_failure rank {comm.rank}\n")
        sys.stdout.flush()
        os._exit(0)  # dies without closing; exit 0 does not end the job
    buf = np.empty(8)
    try:
        await comm.Recv(buf, victim, tag=1, timeout=30)
    except ucxcomm.PeerFailure as exc:
        assert exc.peer == victim, exc.peer
    else:
        raise AssertionError("no PeerFailure")
    try:
        await comm.Send(np.zeros(1 << 20), victim, tag=1, timeout=30)
    except ucxcomm.PeerFailure:
        pass
    else:
        raise AssertionError("send to a dead peer succeeded")
    # The survivors can still talk among themselves.
    live = comm.size - 1
    if live > 1:
        right, left = (comm.rank + 1) % live, (comm.rank - 1) % live
        got = await comm.sendrecv(comm.rank, right, source=left, timeout=30)
        assert got == left
    comm.abort()
    return "aborted"


@case
async def split_rendezvous(comm):
    """Messages from ``UCXCOMM_P2P_SPLIT`` bytes between ranks of one host take the
    split rendezvous (the sender writes the first half of the receive buffer while the
    receiver reads the rest): every receive path gets the message's bytes and status.
    Receives waiting in place, posted before the send, after it, from ANY_SOURCE with
    ANY_TAG, with a Sendrecv; truncation into a smaller buffer (Recv and a posted Irecv:
    the prefix); probe and iprobe report the message's own size, and a receive after
    them still takes an earlier small message first; requests that reach posted receives
    (a sender splitting from a smaller size). The engine's tallies show the requests and
    the senders' shares (none with the setting at 0)."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    eng = comm._world.worker.engine
    smin = comm._world.split_min
    before = (eng.split_sent, eng.split_received, eng.split_shared)
    base = smin or 262144
    count = 0
    for n in (base, base + 1, 3 * base + 7, 4 << 20):
        want = make(n, np.uint8, r)
        got = np.zeros(n, np.uint8)
        sreq = comm.Isend(want, right, 3)
        st = await comm.Recv(got, left, 3)
        await sreq
        assert np.array_equal(got, make(n, np.uint8, left)), n
        assert (st.source, st.tag, st.nbytes) == (left, 3, n), st
        got[:] = 0
        rreq = comm.Irecv(got, ANY_SOURCE, ANY_TAG)
        await comm.barrier()  # (posted before the message comes)
        await comm.Send(bytes(want), right, 4)  # (read-only memory to send from)
        st = await rreq
        assert np.array_equal(got, make(n, np.uint8, left)), n
        assert (st.source, st.tag, st.nbytes) == (left, 4, n), st
        count += 2
    n = 3 * base // 8 + 5
    out = np.zeros(n, np.float64)
    st = await comm.Sendrecv(make(n, np.float64, r), right, out, left, sendtag=5, recvtag=5)
    assert np.array_equal(out, make(n, np.float64, left)) and st.nbytes == n * 8
    count += 1
    # Truncation: Recv, and a posted Irecv, hold the prefix; the next message is whole.
    n = 2 * base
    sreq = comm.Isend(make(n, np.uint8, r), right, 6)
    small = np.zeros(n // 2, np.uint8)
    try:
        await comm.Recv(small, left, 6)
    except ucxcomm.TruncationError as exc:
        assert (exc.nbytes, exc.capacity) == (n, n // 2), (exc.nbytes, exc.capacity)
    else:
        raise AssertionError("no TruncationError")
    assert np.array_equal(small, make(n, np.uint8, left)[:n // 2])
    await sreq
    for cap in (64, 8):  # (8 bytes: below a request's own size)
        small = np.zeros(cap, np.uint8)
        rreq = comm.Irecv(small, left, 7)
        await comm.barrier()
        sreq = comm.Isend(make(n, np.uint8, r), right, 7)
        try:
            await rreq
        except ucxcomm.TruncationError as exc:
            assert (exc.nbytes, exc.capacity) == (n, cap), (exc.nbytes, exc.capacity)
        else:
            raise AssertionError("no TruncationError")
        if smin:  # (the sender, asked by the tag, writes what fits)
            assert np.array_equal(small, make(n, np.uint8, left)[:cap]), small[:8]
        else:  # (UCX's posted receive leaves an overflowed buffer as is)
            assert not small.any(), small[:8]
        await sreq
    count += 3
    # Probes: the split message's own size; a small message sent before it still
    # comes first to a receive that matches both.
    n = base + 12345
    s1 = comm.Isend(np.array([r], np.int64), right, 8)
    s2 = comm.Isend(make(n, np.uint8, r), right, 9)
    st = await comm.probe(left, 9)
    assert (st.source, st.tag, st.nbytes) == (left, 9, n), st
    seen = comm.iprobe(left, 9)
    assert seen is not None and seen.nbytes == n, seen
    first = np.zeros(n, np.uint8)
    st = await comm.Recv(first, left, ANY_TAG)
    assert (st.tag, st.nbytes) == (8, 8) and first[:8].view(np.int64)[0] == left, st
    st = await comm.Recv(first, left, ANY_TAG)
    assert (st.tag, st.nbytes) == (9, n) and np.array_equal(first, make(n, np.uint8, left))
    await ucxcomm.Request.waitall([s1, s2])
    count += 1
    # Senders that split from a smaller size than their receivers' receives are posted
    # below: the requests reach posted receives (four into one buffer, four into their
    # own), which ask the sender by tag; every message arrives whole, in order.
    if smin:
        eng._split_min = 4096
        try:
            n = 65536 + 3
            shared = np.zeros(n, np.uint8)
            own = [np.zeros(n, np.uint8) for _ in range(4)]
            reqs = [comm.Irecv(shared, left, 10) for _ in range(4)]
            reqs += [comm.Irecv(b, left, 11) for b in own]
            await comm.barrier()
            sends = [comm.Isend(make(n, np.uint8, r), right, 10) for _ in range(4)]
            sends += [comm.Isend(make(n, np.uint8, r + k), right, 11) for k in range(4)]
            sts = await ucxcomm.Request.waitall(reqs)
            await ucxcomm.Request.waitall(sends)
            assert all(st.nbytes == n and st.source == left for st in sts), sts
            assert np.array_equal(shared, make(n, np.uint8, left))
            for k, b in enumerate(own):
                assert np.array_equal(b, make(n, np.uint8, left + k)), k
            count += 8
        finally:
            eng._split_min = smin
    await comm.barrier()
    after = (eng.split_sent, eng.split_received, eng.split_shared)
    if smin and p > 1:
        assert after[0] - before[0] == count and after[1] - before[1] == count, (before, after)
        assert after[2] > before[2], ("no share written", before, after)
    else:
        assert after == before, (before, after)


@case
async def split_closed_endpoint(comm):
    """A split request matched after its receiver closed the endpoint to the sender
    (rank 0 aborts it between the request's arrival and its receive): no control
    message goes out on the closed endpoint (before, the CTS went out on the closed
    endpoint's handle and the message arrived as if nothing had closed); the receive
    raises PeerFailure. Rank 1's send fails once rank 0 is gone."""
    n = 1 << 20
    await comm.barrier()
    if comm.rank == 1:
        try:
            await comm.Isend(np.ones(n, np.uint8), 0, 1)
        except ucxcomm.PeerFailure:
            pass
        else:
            raise AssertionError("the send completed without its receiver")
        return "ok"
    st = await comm.probe(1, 1)  # (the request is here, held)
    assert st.nbytes == n, st
    comm._world.endpoint(1).abort()
    got = np.zeros(n, np.uint8)
    try:
        await comm.Recv(got, 1, 1, timeout=30)
    except ucxcomm.PeerFailure:
        pass
    else:
        raise AssertionError("received over a closed endpoint")
    sys.stdout.write("CASE-OK split_closed_endpoint rank 0\n")
    sys.stdout.flush()
    os._exit(0)  # (rank 1 learns of it from the store)


@case
async def split_peer_dies(comm):
    """A split rendezvous with a peer that dies: rank 1 sends a large message and exits
    without progressing (its share is never written), then rank 0 sends one to rank 1,
    which never receives it; both of rank 0's operations raise PeerFailure, none hangs
    and no receive reports the unwritten share as data."""
    n = 4 << 20
    await comm.barrier()
    if comm.rank == 1:
        comm.Isend(np.ones(n, np.uint8), 0, 1)
        # The request reaches rank 0, whose receive matches it and asks for this rank's
        # share, which this rank (not progressing: a blocking sleep) never writes.
        time.sleep(0.3)  # noqa: ASYNC251 (blocking on purpose)
        sys.stdout.write("CASE-OK split_peer_dies rank 1\n")
        sys.stdout.flush()
        os._exit(0)
    got = np.zeros(n, np.uint8)
    try:
        await comm.Recv(got, 1, 1, timeout=60)
    except ucxcomm.PeerFailure as exc:  # (the split rendezvous: the share never came)
        assert exc.peer == 1, exc.peer
    else:  # (UCX's rendezvous reads it all while the sender sleeps)
        assert comm._world.split_min == 0 and (got == 1).all(), "stale bytes as data"
    try:
        await comm.Send(np.zeros(n, np.uint8), 1, 2, timeout=60)
    except ucxcomm.PeerFailure:
        pass
    else:
        raise AssertionError("a send to a dead peer completed")
    comm.abort()
    return "aborted"


@case
async def closed(comm):
    await comm.close()
    for call in (lambda: comm.Isend(b"x", 0), lambda: comm.irecv(0),
                 lambda: comm.isend(1, 0)):
        try:
            call()
        except ucxcomm.ClosedError:
            pass
        else:
            raise AssertionError("operation on a closed comm")
    return "closed"


@case
async def gpu_buffers(comm):
    """cupy arrays end to end: Send/Recv straight between device buffers, truncation on
    the device, and a cupy array inside an object (run only where CUDA exists)."""
    import cupy

    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for n in (1, 8193, 1 << 22):
        src = cupy.arange(n, dtype=cupy.float32) + comm.rank
        dst = cupy.zeros(n, dtype=cupy.float32)
        req = comm.Isend(src, right, tag=n % 1000)
        status = await comm.Recv(dst, left, tag=n % 1000)
        await req
        assert status.nbytes == n * 4
        assert bool((dst == cupy.arange(n, dtype=cupy.float32) + left).all())
    big = cupy.ones(1000, cupy.int64)
    small = cupy.zeros(10, cupy.int64)
    req = comm.Isend(big, right, tag=5)
    try:
        await comm.Recv(small, left, tag=5)
    except ucxcomm.TruncationError:
        assert bool((small == 1).all())
    else:
        raise AssertionError("no TruncationError on the device")
    await req
    got = await comm.sendrecv({"x": cupy.full(3, comm.rank)}, right, source=left)
    assert int(got["x"][0]) == left


async def _stream_order(comm, full) -> None:
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    n = 1 << 18
    a = full((2048, 2048), 1.0 / 2048)
    for trial in range(3):
        busy = a
        for _ in range(20):
            busy = busy @ a  # queued, not waited for
        src = full((n,), 10.0 * trial + comm.rank)  # queued behind them
        dst = full((n,), -1.0)
        req = comm.Isend(src, right, tag=trial)
        await comm.Recv(dst, left, tag=trial)
        await req
        assert bool((dst == 10.0 * trial + left).all()), (trial, dst[:4], dst[-4:])
        assert float(busy[0, 0]) > 0


@case
async def gpu_stream_order(comm):
    """GPU buffers handed over right behind the kernels that write them, with no
    synchronize by the caller: a send carries what the stream produced, and a fill still
    queued for a receive buffer does not overwrite the data received (ucxcomm waits for
    the stream the buffer's CUDA Array Interface names). Milliseconds of matrix products
    queued first keep the stream busy while the message moves."""
    import cupy

    await _stream_order(comm, lambda shape, v: cupy.full(shape, v, cupy.float32))


@case
async def gpu_stream_order_torch(comm):
    """The same with torch CUDA tensors, whose interface names no stream (ucxcomm waits
    for torch's current stream on the tensor's device)."""
    import torch

    dev = torch.device("cuda", comm.rank % torch.cuda.device_count())
    await _stream_order(comm, lambda shape, v: torch.full(shape, v, device=dev))


if __name__ == "__main__":
    cases.main()

"""SPMD cases of the node's shared-memory collective engine (``comm/shm.py``;
tests/test_shm.py). Run one: ``ucxcomm run -n 3 python tests/spmd/shm_cases.py NAME``;
each rank prints ``CASE-OK NAME rank R`` when its assertions passed."""

from __future__ import annotations

import asyncio
import os

import numpy as np

import ucxcomm
from ucxcomm import IN_PLACE, settings
from ucxcomm.comm import algorithms, shm
from ucxcomm.testing import Cases

cases = Cases()
case = cases.case

T = 20.0  # each call's deadline: a hang fails the case instead of hanging it


def _engine(comm):
    """The communicator's engine, which must have served its calls."""
    sh = comm._shm
    assert sh is not None and sh._node is not None, "the shared-memory engine was not used"
    return sh


async def _raises(kind, call):
    """The ``kind`` exception awaiting ``call()`` raised (an AssertionError if none)."""
    try:
        await call()
    except kind as exc:
        return exc
    raise AssertionError(f"no {kind.__name__}")


def _listing():
    return {f"{shm.SHM_DIR}/{name}" for name in os.listdir(shm.SHM_DIR)}


def _data(rank, n, dtype, salt=0):
    k = (np.arange(n, dtype=np.int64) * 7 + rank * 13 + salt) % 5
    return (k + 1).astype(dtype)


async def _more_allreduces(comm, n, result):
    """``result`` (an Allreduce's output) is the same bytes on every rank; then an
    in-place MAX and a float16 PROD (numpy's kernel) of ``n`` elements, checked."""
    r, p = comm.rank, comm.size
    every = await comm.allgather(result.tobytes())
    assert all(e == every[0] for e in every), "Allreduce differs between ranks"
    y = _data(r, n, np.int64)
    await comm.Allreduce(IN_PLACE, y, op=ucxcomm.MAX, timeout=T)
    assert np.array_equal(y, np.max([_data(k, n, np.int64) for k in range(p)], axis=0))
    h = _data(r, n, np.float16)
    hp = np.empty_like(h)
    await comm.Allreduce(h, hp, op=ucxcomm.PROD, timeout=T)  # (numpy's kernel)
    ref16 = _data(0, n, np.float16)
    for k in range(1, p):
        ref16 = ref16 * _data(k, n, np.float16)
    assert np.array_equal(hp, ref16)


@case
async def every_collective_every_size(comm):
    """Bcast (every root), Allgather, Alltoall, Allreduce and Reduce_scatter_block just
    above the small paths up to several rings of slots, with odd counts and in place,
    checked against numpy; the float sums are bit-identical on every rank."""
    r, p = comm.rank, comm.size
    for n in (1025, 8191, 70001, 300_007):
        for root in range(p):
            b = _data(root, n, np.float64) if r == root else np.zeros(n)
            await comm.Bcast(b, root=root, timeout=T)
            assert np.array_equal(b, _data(root, n, np.float64)), (n, root)
        blk = n // p + 1
        out = np.empty(blk * p, np.int32)
        await comm.Allgather(_data(r, blk, np.int32), out, timeout=T)
        assert np.array_equal(out, np.concatenate([_data(k, blk, np.int32) for k in range(p)]))
        out2 = out.copy()
        out2[r * blk:(r + 1) * blk] = _data(r, blk, np.int32, 1)
        out2[:r * blk] = 0
        await comm.Allgather(IN_PLACE, out2, timeout=T)
        want = [_data(k, blk, np.int32, 1) for k in range(p)]
        assert np.array_equal(out2, np.concatenate(want))
        send = np.concatenate([_data(r * p + j, blk, np.int64) for j in range(p)])
        got = np.empty_like(send)
        await comm.Alltoall(send, got, timeout=T)
        assert np.array_equal(got, np.concatenate([_data(k * p + r, blk, np.int64)
                                                   for k in range(p)]))
        inplace = send.copy()
        await comm.Alltoall(IN_PLACE, inplace, timeout=T)
        assert np.array_equal(inplace, got)
        x = _data(r, n, np.float64) / 3
        s = np.empty(n)
        await comm.Allreduce(x, s, timeout=T)
        ref = _data(0, n, np.float64) / 3
        for k in range(1, p):
            ref = ref + _data(k, n, np.float64) / 3
        tuning = algorithms.TUNING
        if n * 8 <= tuning["shm_max_Allreduce"] and (
                not comm._shm.crowded or n * 8 <= tuning["shm_max_fold_crowded"]):
            assert np.array_equal(s, ref), "not the rank-order fold"  # (the engine's)
        assert np.allclose(s, ref)
        await _more_allreduces(comm, n, s)
        rs_in = _data(r, blk * p, np.float32)
        rs_out = np.empty(blk, np.float32)
        await comm.Reduce_scatter_block(rs_in, rs_out, timeout=T)
        full = _data(0, blk * p, np.float32)
        for k in range(1, p):
            full = full + _data(k, blk * p, np.float32)
        assert np.array_equal(rs_out, full[r * blk:(r + 1) * blk])
        rs_inplace = rs_in.copy()
        await comm.Reduce_scatter_block(IN_PLACE, rs_inplace, timeout=T)
        assert np.array_equal(rs_inplace[:blk], rs_out)
        mx = np.empty(blk, np.int64)  # (numpy's kernel, the own block from the input)
        await comm.Reduce_scatter_block(_data(r, blk * p, np.int64), mx, op=ucxcomm.MAX,
                                        timeout=T)
        want_mx = np.max([_data(k, blk * p, np.int64) for k in range(p)], axis=0)
        assert np.array_equal(mx, want_mx[r * blk:(r + 1) * blk])
    _engine(comm)


@case
async def rooted_collectives(comm):
    """Gather, Scatter and Reduce (every size: they have no small path of their own),
    every root, IN_PLACE at the root, numpy-kernel ops."""
    r, p = comm.rank, comm.size
    for n in (1, 7, 1025, 70001, 300_007):
        for root in range(p):
            mine = _data(r, n, np.float64)
            out = np.full(n * p, -1.0) if r == root else None
            await comm.Gather(mine, out, root=root, timeout=T)
            if r == root:
                assert np.array_equal(out, np.concatenate([_data(k, n, np.float64)
                                                           for k in range(p)])), (n, root)
                out[:] = 0
                out[r * n:(r + 1) * n] = mine
                await comm.Gather(IN_PLACE, out, root=root, timeout=T)
                assert np.array_equal(out, np.concatenate([_data(k, n, np.float64)
                                                           for k in range(p)])), (n, root)
            else:
                await comm.Gather(mine, None, root=root, timeout=T)
            src = _data(root, n * p, np.int32) if r == root else None
            got = np.full(n, -1, np.int32)
            await comm.Scatter(src, got, root=root, timeout=T)
            assert np.array_equal(got, _data(root, n * p, np.int32)[r * n:(r + 1) * n])
            if r == root:
                await comm.Scatter(src, IN_PLACE, root=root, timeout=T)
                assert np.array_equal(src, _data(root, n * p, np.int32))
            else:
                await comm.Scatter(None, got, root=root, timeout=T)
            x = _data(r, n, np.float32)
            red = np.full(n, -1.0, np.float32) if r == root else None
            await comm.Reduce(x, red, root=root, timeout=T)
            if r == root:
                ref = _data(0, n, np.float32)
                for k in range(1, p):
                    ref = ref + _data(k, n, np.float32)
                assert np.allclose(red, ref), (n, root)
            y = _data(r, n, np.int16)
            hi = np.empty(n, np.int16) if r == root else None
            await comm.Reduce(y, hi, op=ucxcomm.MAX, root=root, timeout=T)
            if r == root:
                assert np.array_equal(hi, np.max([_data(k, n, np.int16) for k in range(p)],
                                                 axis=0))
                z = _data(r, n, np.int64)
                await comm.Reduce(IN_PLACE, z, root=root, timeout=T)
                assert np.array_equal(z, np.sum([_data(k, n, np.int64) for k in range(p)],
                                                axis=0))
            else:
                await comm.Reduce(_data(r, n, np.int64), None, root=root, timeout=T)
    _engine(comm)


@case
async def lean_and_general_entries_meet(comm):
    """Every engine collective where the even ranks pass plain numpy arrays (the lean
    entry of comm/collectives.py) and the odd ones memoryviews and 2-D arrays (the
    general entry): both reach the engine with the same call, and the results are
    numpy's."""
    r, p = comm.rank, comm.size
    odd = r % 2 == 1

    def wrap(a):
        return memoryview(a) if odd else a

    sh = None
    for n in (5000, 70001):
        blk = n
        src = _data(7, n, np.float64)
        b = src.copy() if r == 1 else np.zeros(n)
        await comm.Bcast(wrap(b), root=1, timeout=T)
        assert np.array_equal(b, src)
        out = np.zeros(blk * p, np.int32)
        await comm.Allgather(wrap(_data(r, blk, np.int32)), wrap(out), timeout=T)
        assert np.array_equal(out, np.concatenate([_data(k, blk, np.int32) for k in range(p)]))
        send = np.concatenate([_data(r * p + j, blk, np.int64) for j in range(p)])
        got = np.zeros_like(send)
        await comm.Alltoall(wrap(send), got.reshape(p, blk) if odd else got, timeout=T)
        assert np.array_equal(got, np.concatenate([_data(k * p + r, blk, np.int64)
                                                   for k in range(p)]))
        x = _data(r, blk * p, np.float32)
        s = np.zeros(blk * p, np.float32)
        await comm.Allreduce(wrap(x), wrap(s), timeout=T)
        ref = sum(_data(k, blk * p, np.float32) for k in range(p))
        assert np.allclose(s, ref)
        rs = np.zeros(blk, np.float32)
        await comm.Reduce_scatter_block(wrap(x), wrap(rs), timeout=T)
        assert np.allclose(rs, ref[r * blk:(r + 1) * blk])
        for root in range(p):
            g = np.zeros(blk * p, np.int32) if r == root else None
            await comm.Gather(wrap(_data(r, blk, np.int32)), None if g is None else wrap(g),
                              root=root, timeout=T)
            if r == root:
                assert np.array_equal(g, np.concatenate([_data(k, blk, np.int32)
                                                         for k in range(p)]))
            sc = _data(root, blk * p, np.int32) if r == root else None
            mine = np.zeros(blk, np.int32)
            await comm.Scatter(None if sc is None else wrap(sc), wrap(mine), root=root,
                               timeout=T)
            assert np.array_equal(mine, _data(root, blk * p, np.int32)[r * blk:(r + 1) * blk])
            red = np.zeros(blk, np.float32) if r == root else None
            await comm.Reduce(wrap(_data(r, blk, np.float32)),
                              None if red is None else wrap(red), root=root, timeout=T)
            if r == root:
                assert np.allclose(red, sum(_data(k, blk, np.float32) for k in range(p)))
        sh = _engine(comm)
    assert sh is not None and sh.off is None, "a member left the engine"


@case
async def engine_calls_across_the_sequence_wrap(comm):
    """The sequence numbers wrap (TAG_UB, then 0) between engine calls of both entries
    (the compiled one of blocking calls, the Python one of non-blocking calls): the
    calls' generations keep rising, and every call gets its data."""
    r, p = comm.rank, comm.size
    b = np.zeros(20000)
    await comm.Bcast(b, root=0, timeout=T)  # (segments made and mapped)
    g = comm._group
    g._coll_seq = ucxcomm.TAG_UB - 3
    wraps = g.seq_wraps
    for i in range(8):
        root = i % p
        b[:] = i + 1 if r == root else 0
        if i % 2:
            await asyncio.wait_for(comm.Ibcast(b, root=root), T)
        else:
            await comm.Bcast(b, root=root, timeout=T)
        assert np.all(b == i + 1), (i, b[:4])
        out = np.zeros(2048 * p)
        await comm.Allgather(np.full(2048, r + i, float), out, timeout=T)
        assert np.array_equal(out, np.repeat(np.arange(p, dtype=float) + i, 2048))
    assert g.seq_wraps == wraps + 1 and g.last_seq < 20, (g.seq_wraps, g.last_seq)
    assert comm._entry is not None, "the compiled entry never served a call"
    _engine(comm)


@case
async def allreduce_in_two_stages(comm):
    """From 4 ranks an Allreduce whose count splits into equal blocks takes two engine
    stages (reduce-scatter, then allgather: two sequence numbers): sums in rank order,
    bit-identical on every rank, in place, numpy-kernel ops, odd ranks on the general
    entry (memoryviews); a rank that would take one stage while the others take two
    (its TUNING differs) meets a CollectiveMismatch on every rank, not a hang."""
    r, p = comm.rank, comm.size
    assert p >= 4
    odd = r % 2 == 1
    g = comm._group
    for n in (2052 * p, 70000 * p // 4 * 4, (1 << 20) // 8):
        x = _data(r, n, np.float64) / 3
        out = np.full(n, -1.0)
        before = g.last_seq
        await comm.Allreduce(memoryview(x) if odd else x, memoryview(out) if odd else out,
                             timeout=T)
        assert g.last_seq == (before + 2) & ucxcomm.TAG_UB, "not two stages"
        ref = _data(0, n, np.float64) / 3
        for k in range(1, p):
            ref = ref + _data(k, n, np.float64) / 3
        assert np.array_equal(out, ref), "not the rank-order fold"
        await _more_allreduces(comm, n, out)
        ireq = comm.Iallreduce(x, out)
        await asyncio.wait_for(ireq, T)
        assert np.array_equal(out, ref)
    _engine(comm)
    if not g.check:
        return None  # (checks off: a mismatch is the caller's to avoid)
    tuning = algorithms.TUNING
    if r == 0:
        tuning["shm_allreduce_stages_min"] = 1 << 62
    n = 4096 * p
    out = np.full(n, -7.0)
    exc = await _raises(ucxcomm.CollectiveMismatch,
                        lambda: comm.Allreduce(np.ones(n), out, timeout=T))
    assert f"Allreduce(float64[{n}]" in str(exc), exc
    tuning["shm_allreduce_stages_min"] = 0
    ok = np.empty(n)
    await comm.Allreduce(np.ones(n), ok, timeout=T)
    assert (ok == p).all()
    _engine(comm)


@case
async def reduce_in_two_stages(comm):
    """From 4 ranks a Reduce whose count splits into equal blocks takes two engine
    stages (reduce-scatter, then a gather to the root: two sequence numbers): every
    root, the root's result the rank-order fold, in place at the root, a numpy-kernel
    op, odd ranks on the general entry, the non-roots' scratch reused; ranks that
    disagree about the root, or a rank on the one-call form, meet a
    CollectiveMismatch on every rank, not a hang."""
    r, p = comm.rank, comm.size
    assert p >= 4
    odd = r % 2 == 1
    g = comm._group
    tuning = algorithms.TUNING
    assert tuning["shm_reduce_stages_min"] <= (1 << 20), "the sizes below are one-call"
    for n in (tuning["shm_reduce_stages_min"] // 8 + 4 * p, (1 << 20) // 8):
        for root in range(p):
            x = _data(r, n, np.float64) / 3
            out = np.full(n, -1.0) if r == root else None
            before = g.last_seq
            await comm.Reduce(memoryview(x) if odd else x,
                              None if out is None else (memoryview(out) if odd else out),
                              root=root, timeout=T)
            assert g.last_seq == (before + 2) & ucxcomm.TAG_UB, "not two stages"
            if r == root:
                ref = _data(0, n, np.float64) / 3
                for k in range(1, p):
                    ref = ref + _data(k, n, np.float64) / 3
                assert np.array_equal(out, ref), ("not the rank-order fold", root)
            y = _data(r, n, np.int64)
            if r == root:
                await comm.Reduce(IN_PLACE, y, op=ucxcomm.MAX, root=root, timeout=T)
                assert np.array_equal(y, np.max([_data(k, n, np.int64) for k in range(p)],
                                                axis=0))
            else:
                await comm.Reduce(y, None, op=ucxcomm.MAX, root=root, timeout=T)
                assert np.array_equal(y, _data(r, n, np.int64)), "input written"
        req = comm.Ireduce(x, out, root=p - 1)
        await asyncio.wait_for(req, T)
    _engine(comm)
    if not g.check:
        return None  # (checks off: a mismatch is the caller's to avoid)
    n = tuning["shm_reduce_stages_min"] // 8 + 4 * p
    out = np.full(n, -7.0)
    exc = await _raises(ucxcomm.CollectiveMismatch, lambda: comm.Reduce(
        np.ones(n), out, root=0 if r else 1, timeout=T))
    assert f"Reduce(float64[{n}]" in str(exc), exc
    assert (out == -7.0).all()
    saved = tuning["shm_reduce_stages_min"]
    if r == 0:
        tuning["shm_reduce_stages_min"] = 1 << 62
    exc = await _raises(ucxcomm.CollectiveMismatch,
                        lambda: comm.Reduce(np.ones(n), out, root=1, timeout=T))
    assert f"Reduce(float64[{n}]" in str(exc), exc
    tuning["shm_reduce_stages_min"] = saved
    await comm.Reduce(np.ones(n), out, root=2, timeout=T)
    if r == 2:
        assert (out == p).all()
    _engine(comm)


@case
async def bad_input_once_the_engine_is_up(comm):
    """Once the engine's compiled entry exists (after a first call), every bad argument
    it passes on still gets the Python entry's clear error at the call: no sequence
    number taken, no buffer written; the next good call works on every rank."""
    r, p = comm.rank, comm.size
    n = 4096 * p
    b = np.zeros(n)
    await comm.Bcast(b, root=0, timeout=T)
    assert comm._entry is not None, "the compiled entry was not made"
    g = comm._group
    ro = np.zeros(n)
    ro.flags.writeable = False
    strided = np.zeros(2 * n)[::2]
    out = np.full(n, -7.0)
    blk = np.full(n // p, -7.0)
    f32 = np.ones(n // p, np.float32)
    cases = [
        (ValueError, "read-only", lambda: comm.Bcast(ro, root=(r + 1) % p)),
        (ValueError, "out of range", lambda: comm.Bcast(b, root=p)),
        (TypeError, "dtypes differ", lambda: comm.Allgather(f32, out)),
        (ValueError, "expected", lambda: comm.Allgather(np.ones(n // p + 1), out)),
        (ValueError, "not contiguous", lambda: comm.Alltoall(np.ones(n), strided)),
        (ValueError, "counts differ", lambda: comm.Alltoall(np.ones(n + p), out)),
        (TypeError, "ucxcomm.Op", lambda: comm.Allreduce(np.ones(n), out, op="sum")),
        (TypeError, "not defined", lambda: comm.Allreduce(
            np.ones(n, complex), np.zeros(n, complex), op=ucxcomm.MAX)),
        (ValueError, "needed", lambda: comm.Reduce_scatter_block(
            np.ones(n), np.zeros(n // p - 1))),
        (ValueError, "equal blocks", lambda: comm.Gather(np.ones(n // p), blk, root=r)),
        (TypeError, "object", lambda: comm.Gather(np.empty(n // p, object), out, root=r)),
        (ValueError, "equal blocks", lambda: comm.Scatter(np.ones(n + 1), blk, root=r)),
        (ValueError, "needs a receive buffer", lambda: comm.Reduce(np.ones(n), None, root=r)),
    ]
    for kind, text, call in cases:
        before = g.last_seq
        try:
            await asyncio.wait_for(call(), T)
        except kind as e:
            exc = e
        else:
            raise AssertionError(f"no {kind.__name__} ({text})")
        assert text in str(exc), (text, exc)
        assert g.last_seq == before, ("a sequence number was taken", text)
        assert (out == -7.0).all() and (blk == -7.0).all(), ("a buffer was written", text)
    x = np.full(n, r + 1.0)
    await comm.Allreduce(x, out, timeout=T)
    assert (out == p * (p + 1) / 2).all()
    _engine(comm)


@case
async def single_copy_mode(comm):
    """Large Bcast, Allgather and Alltoall read straight out of the writers' buffers
    (no piece through the segments) unless UCXCOMM_SHM_DIRECT=no; the data is right
    either way, and a writer's buffer may be reused at once after its call."""
    r, p = comm.rank, comm.size
    on = os.environ.get("UCXCOMM_SHM_DIRECT", "yes") != "no"
    await comm.Bcast(np.zeros(2048), root=0, timeout=T)  # (maps the segments: probed)
    before = _engine(comm)._node.pieces
    n = 1 << 18
    for root in range(p):
        b = _data(root, n, np.float64) if r == root else np.zeros(n)
        await comm.Bcast(b, root=root, timeout=T)
        assert np.array_equal(b, _data(root, n, np.float64))
        if r == root:
            b[:] = -1  # (every reader is done with it)
    mine = _data(r, n, np.int32)
    out = np.empty(n * p, np.int32)
    await comm.Allgather(mine, out, timeout=T)
    mine[:] = -1
    assert np.array_equal(out, np.concatenate([_data(k, n, np.int32) for k in range(p)]))
    send = _data(r, n * p, np.int16)
    got = np.empty_like(send)
    await comm.Alltoall(send, got, timeout=T)
    want = np.concatenate([_data(k, n * p, np.int16)[r * n:(r + 1) * n] for k in range(p)])
    assert np.array_equal(got, want)
    sh = _engine(comm)
    assert sh._node.direct_ok() is on
    assert (sh._node.pieces == before) is on, (before, sh._node.pieces)
    # Every rank was a Bcast root of 2 MiB: it pushed its readers' shares, unless
    # single-copy mode or pushing is off (UCXCOMM_SHM_PUSH=no).
    push = on and os.environ.get("UCXCOMM_SHM_PUSH", "yes") != "no"
    assert (sh._node.pushed > 0) is push, (push, sh._node.pushed)


@case
async def names_go_once_mapped(comm):
    """Every rank's segment is mapped by all and its name unlinked after the first call:
    a job that dies later leaves nothing under /dev/shm."""
    b = np.zeros(4096)
    await comm.Bcast(b, root=0, timeout=T)
    await comm.barrier(timeout=T)
    sh = _engine(comm)
    left = [p for p in sh._paths if p in _listing()]
    assert not left, left


@case
async def checks_off_runs_ahead(comm):
    """With the checks off a root runs ahead of its readers by up to a ring of slots and
    of records; many small Bcasts in a row, then every rank's data is right."""
    assert not comm._group.check
    r = comm.rank
    bufs = [np.full(2048, -1.0) for _ in range(40)]
    for i, b in enumerate(bufs):
        if r == 0:
            b[:] = i
        await comm.Bcast(b, root=0, timeout=T)
    assert all((b == i).all() for i, b in enumerate(bufs))
    _engine(comm)


@case
async def checks_off_a_writer_ahead_of_its_readers_segments(comm):
    """With the checks off a writer needs nobody's record: on a fresh communicator it
    may fill its ring before its readers have even made their segments. It keeps
    mapping them while it waits for a slot (it used to stop once its call was verified:
    it then waited forever). A Bcast root and Gather and Reduce writers, each first on
    a communicator of its own, their readers late (run it with small rings: a Reduce
    of two default rings is above the engine's limit where ranks outnumber cores)."""
    assert not comm._group.check
    r, p = comm.rank, comm.size
    ring = int(settings.get("UCXCOMM_SHM_SLOT")) * int(settings.get("UCXCOMM_SHM_SLOTS"))
    n = 2 * ring // 8 + 1  # (float64: two rings' worth)
    sub = await comm.dup()
    if r != 0:
        await asyncio.sleep(0.3)
    b = np.arange(n, dtype=np.float64) if r == 0 else np.zeros(n)
    await sub.Bcast(b, root=0, timeout=T)
    assert np.array_equal(b, np.arange(n, dtype=np.float64))
    _engine(sub)
    for what in ("Gather", "Reduce"):
        sub = await comm.dup()
        if r == 0:
            await asyncio.sleep(0.3)
        mine = _data(r, n, np.float64)
        out = np.empty(n * p if what == "Gather" else n) if r == 0 else None
        if what == "Gather":
            await sub.Gather(mine, out, root=0, timeout=T)
            want = np.concatenate([_data(k, n, np.float64) for k in range(p)])
        else:
            await sub.Reduce(mine, out, root=0, timeout=T)
            want = np.sum([_data(k, n, np.float64) for k in range(p)], axis=0)
        if r == 0:
            assert np.array_equal(out, want), what
        _engine(sub)


@case
async def mismatch_across_paths(comm):
    """A call that takes the engine on some ranks and another path on others (a count on
    each side of a threshold) raises CollectiveMismatch on every rank, naming both
    calls, with the receive buffers unwritten; the next matching call works."""
    r, p = comm.rank, comm.size
    # Bcast: rank 1 passes 8 KiB (the small path), the others 16 KiB (the engine).
    n = 1024 if r == 1 else 2048
    buf = np.full(n, -7.0) if r else np.ones(n)
    exc = await _raises(ucxcomm.CollectiveMismatch, lambda: comm.Bcast(buf, root=0, timeout=T))
    assert "Bcast(float64[1024]" in str(exc) and "Bcast(float64[2048]" in str(exc), exc
    if r:
        assert (buf == -7.0).all()
    # Allreduce: rank 0 above the engine's limit (the ring), the others below it.
    lim = algorithms.TUNING["shm_max_Allreduce"] // 8
    m = lim + 8 if r == 0 else lim
    out = np.full(m, -7.0)
    exc = await _raises(ucxcomm.CollectiveMismatch,
                        lambda: comm.Allreduce(np.ones(m), out, timeout=T))
    assert f"Allreduce(float64[{lim + 8}]" in str(exc), exc
    assert (out == -7.0).all()
    ok = np.empty(4096)
    await comm.Allreduce(np.ones(4096), ok, timeout=T)
    assert (ok == p).all()
    _engine(comm)


@case
async def a_rank_without_the_engine(comm):
    """Rank 1 cannot make its segment (here: its directory does not exist): the first
    call raises CollectiveMismatch on every rank saying so, then every rank takes the
    network path and the calls work."""
    r, p = comm.rank, comm.size
    if r == 1:
        shm.SHM_DIR = "/nonexistent-ucxcomm-test"
    buf = np.full(4096, -7.0) if r else np.arange(4096.0)
    exc = await _raises(ucxcomm.CollectiveMismatch, lambda: comm.Bcast(buf, root=0, timeout=T))
    assert "shared memory" in str(exc), exc
    for _ in range(3):
        await comm.Bcast(buf, root=0, timeout=T)
        assert np.array_equal(buf, np.arange(4096.0))
        out = np.empty(4096)
        await comm.Allreduce(np.ones(4096), out, timeout=T)
        assert (out == p).all()
    assert comm._shm.off is not None


@case
async def a_dead_member_fails_the_wait(comm):
    """The last rank dies while the others wait in the engine: they raise PeerFailure."""
    r, p = comm.rank, comm.size
    b = np.zeros(8192)
    await comm.Bcast(b, root=0, timeout=T)  # (the engine is set up)
    if r == p - 1:
        print(f"CASE-OK a_dead_member_fails_the_wait rank {r}", flush=True)
        os._exit(0)  # no close(): the others must find out
    for attempt in (lambda: comm.Bcast(b, root=p - 1),  # (waits for its record)
                    lambda: comm.Allgather(np.ones(2048), np.zeros(2048 * p))):
        exc = await _raises(ucxcomm.PeerFailure, lambda a=attempt: asyncio.wait_for(a(), T))
        assert exc.peer == p - 1, exc
    # The survivors leave together: one that aborted while another still waited for
    # the dead rank would be the failure that other one saw first.
    others = [k for k in range(p - 1) if k != r]
    try:
        await asyncio.wait_for(asyncio.gather(
            *(comm.send(b"done", k, tag=5) for k in others),
            *(comm.recv(k, tag=5) for k in others)), T)
    except ucxcomm.PeerFailure:
        pass  # (a survivor that already had every message left)
    comm.abort()
    return "aborted"


@case
async def a_late_root_times_out(comm):
    """A Bcast whose root never comes raises CommTimeoutError at its deadline and leaves
    that communicator out of step (refused at the call); point-to-point still works."""
    sub = await comm.dup()
    r = comm.rank
    b = np.zeros(8192)
    await sub.Bcast(b, root=0, timeout=T)
    if r != 0:
        await _raises(ucxcomm.CommTimeoutError, lambda: sub.Bcast(b, root=0, timeout=0.3))
        exc = await _raises(ucxcomm.UcxCommError, lambda: sub.Bcast(b, root=0, timeout=T))
        assert "out of step" in str(exc), exc
        await sub.send("done", 0)
    else:
        for q in range(1, comm.size):
            assert await sub.recv(q) == "done"


async def _settle(reqs):
    """Wait for every request in turn (each under the case's deadline): their results,
    or the errors they raised."""
    async def wait(q):
        return await q

    out = []
    for q in reqs:
        try:
            out.append(await asyncio.wait_for(wait(q), T))
        except Exception as exc:  # (the caller checks what each gave)
            out.append(exc)
    return out


def _poster(posted):
    def post(name, req, buf, want):
        posted.append((name, req, buf, want))

    return post


@case
async def overlapping_calls(comm):
    """Several engine calls in flight at once on one rank: non-blocking collectives of
    every kind the engine serves, different roots, posted back to back (with network-path
    calls among them) and only then awaited; blocking ones issued from concurrent tasks
    (asyncio.gather); a posted call that fails (a mismatch) ahead of others. Every result
    is checked exactly. Calls on one communicator take the engine one at a time, in call
    order: they used to share the rank's piece counter, slots and records, and with small
    rings most results were wrong or the calls hung."""
    r, p = comm.rank, comm.size
    n = blk = 3001  # (float64: about 3 rings of two 4 KiB slots a message)
    for it in range(6):
        s = 100 * it
        posted = []  # (name, request, its buffer, what the buffer must hold or None)
        post = _poster(posted)
        root = it % p
        b = _data(root, n, np.float64, s) if r == root else np.full(n, -1.0)
        post("Bcast", comm.Ibcast(b, root=root), b, _data(root, n, np.float64, s))
        groot = (it + 1) % p
        gout = np.full(n * p, -1.0) if r == groot else None
        post("Gather", comm.Igather(_data(r, n, np.float64, s + 1), gout, root=groot), gout,
             np.concatenate([_data(k, n, np.float64, s + 1) for k in range(p)])
             if r == groot else None)
        tiny = np.empty(1)
        post("small Allreduce", comm.Iallreduce(np.full(1, r + 1.0), tiny), tiny,
             np.full(1, p * (p + 1) / 2))  # (the network path, between engine calls)
        sroot = (it + 2) % p
        src = _data(sroot, n * p, np.int32, s + 2) if r == sroot else None
        sout = np.full(n, -1, np.int32)
        post("Scatter", comm.Iscatter(src, sout, root=sroot), sout,
             _data(sroot, n * p, np.int32, s + 2)[r * n:(r + 1) * n])
        rroot = (it + 1) % p
        rout = np.full(n, -1, np.int64) if r == rroot else None
        post("Reduce", comm.Ireduce(_data(r, n, np.int64, s + 3), rout, root=rroot), rout,
             np.sum([_data(k, n, np.int64, s + 3) for k in range(p)], axis=0)
             if r == rroot else None)
        aout = np.full(blk * p, -1, np.int32)
        post("Allgather", comm.Iallgather(_data(r, blk, np.int32, s + 4), aout), aout,
             np.concatenate([_data(k, blk, np.int32, s + 4) for k in range(p)]))
        vout = np.full(3 * p, -1.0) if r == 0 else None
        post("Gatherv", comm.Igatherv(np.full(3, float(r)), (vout, [3] * p) if r == 0 else None,
                                      root=0), vout,
             np.repeat(np.arange(float(p)), 3) if r == 0 else None)  # (network path)
        send = np.concatenate([_data(r * p + j, blk, np.float32, s + 5) for j in range(p)])
        tout = np.full(blk * p, -1, np.float32)
        post("Alltoall", comm.Ialltoall(send, tout), tout,
             np.concatenate([_data(k * p + r, blk, np.float32, s + 5) for k in range(p)]))
        x = _data(r, n, np.float64, s + 6)
        xout = np.full(n, -1.0)
        post("Allreduce", comm.Iallreduce(x, xout), xout,
             np.sum([_data(k, n, np.float64, s + 6) for k in range(p)], axis=0))
        rs = _data(r, blk * p, np.int64, s + 7)
        rsout = np.full(blk, -1, np.int64)
        post("Reduce_scatter_block", comm.Ireduce_scatter_block(rs, rsout), rsout,
             np.sum([_data(k, blk * p, np.int64, s + 7) for k in range(p)],
                    axis=0)[r * blk:(r + 1) * blk])
        big = 1 << 13  # (float64: 64 KiB, single-copy mode where the ranks can)
        bb = _data(1, big, np.float64, s + 8) if r == 1 else np.full(big, -1.0)
        post("Bcast single-copy", comm.Ibcast(bb, root=1), bb, _data(1, big, np.float64, s + 8))
        results = await _settle([q for _, q, _, _ in posted])
        for (name, _, buf, want), res in zip(posted, results, strict=True):
            assert res is None, (it, name, res)
            if want is not None:
                assert np.array_equal(buf, want), (it, name)
        # Each posted call's flight record names its own sequence number (they were
        # read as its task started: the last call's, after every call was posted).
        seqs = [o.seq for o in comm.trace() if o.seq >= 0]
        assert len(seqs) == len(set(seqs)), seqs
        # Blocking calls from concurrent tasks (every rank starts them in the same order).
        g1 = _data(2, n, np.float64, s + 9) if r == 2 else np.full(n, -1.0)
        g2 = np.full(n * p, -1.0)
        g3 = np.full(n, -1.0)
        await asyncio.gather(comm.Bcast(g1, root=2, timeout=T),
                             comm.Allgather(_data(r, n, np.float64, s + 10), g2),
                             comm.Allreduce(_data(r, n, np.float64, s + 11), g3, timeout=T))
        assert np.array_equal(g1, _data(2, n, np.float64, s + 9))
        assert np.array_equal(g2, np.concatenate([_data(k, n, np.float64, s + 10)
                                                  for k in range(p)]))
        assert np.array_equal(g3, np.sum([_data(k, n, np.float64, s + 11) for k in range(p)],
                                         axis=0))
    # A posted call that fails ahead of others (rank 1's count differs: a mismatch on
    # every rank) hands the engine on: the calls behind it run and are right.
    if comm._group.check:
        m = n + 1 if r == 1 else n
        bad = _data(0, m, np.float64) if r == 0 else np.full(m, -1.0)
        q1 = comm.Ibcast(bad, root=0)
        out = np.full(n * p, -1.0)
        q2 = comm.Iallgather(_data(r, n, np.float64, 7), out)
        res = await _settle([q1, q2])
        assert isinstance(res[0], ucxcomm.CollectiveMismatch), res
        assert res[1] is None, res
        assert np.array_equal(out, np.concatenate([_data(k, n, np.float64, 7)
                                                   for k in range(p)]))
        # A mismatch across paths found by a call that waited in line: rank 1's Bcast
        # takes the small path (8 KiB) while the others' waits behind an Allgather.
        first = np.full(n * p, -1.0)
        q0 = comm.Iallgather(_data(r, n, np.float64, 8), first)
        m = 1024 if r == 1 else 2048
        other = np.full(m, -7.0) if r else np.ones(m)
        q1 = comm.Ibcast(other, root=0)
        last = np.full(n * p, -1.0)
        q2 = comm.Iallgather(_data(r, n, np.float64, 9), last)
        res = await _settle([q0, q1, q2])
        assert res[0] is None and res[2] is None, res
        assert isinstance(res[1], ucxcomm.CollectiveMismatch), res
        assert "Bcast(float64[1024]" in str(res[1]) and "Bcast(float64[2048]" in str(res[1])
        if r:
            assert (other == -7.0).all()
        assert np.array_equal(first, np.concatenate([_data(k, n, np.float64, 8)
                                                     for k in range(p)]))
        assert np.array_equal(last, np.concatenate([_data(k, n, np.float64, 9)
                                                    for k in range(p)]))
    _engine(comm)


if __name__ == "__main__":
    cases.main()

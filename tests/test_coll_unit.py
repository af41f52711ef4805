"""Unit tests of the collective building blocks (no processes, no UCX)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import ucxcomm
from ucxcomm.comm import algorithms as alg
from ucxcomm.comm.collectives import _counts, _displs, _ufunc


@pytest.mark.parametrize("p", range(1, 18))
def test_binomial_tree_is_a_tree(p):
    """Every rank but the root has one parent that lists it as a child; each child's
    subtree is a contiguous range (so rank-order reductions stay in rank order)."""
    parents = {}
    for v in range(p):
        parent, children = alg.binomial(v, p)
        assert (parent is None) == (v == 0)
        for c in children:
            assert alg.binomial(c, p)[0] == v
            parents[c] = v
        assert children == sorted(children, reverse=True)  # largest subtree first
    assert sorted(parents) == list(range(1, p))

    def subtree(v):
        out = [v]
        for c in alg.binomial(v, p)[1]:
            out += subtree(c)
        return sorted(out)

    for v in range(p):
        s = subtree(v)
        assert s == list(range(s[0], s[0] + len(s)))
    assert subtree(0) == list(range(p))


@pytest.mark.parametrize("n,p", [(0, 3), (1, 4), (10, 3), (7, 7), (1000, 6)])
def test_blocks_cover_everything(n, p):
    counts, displs = alg.blocks(n, p)
    assert sum(counts) == n and max(counts) - min(counts) <= 1
    assert displs == [sum(counts[:i]) for i in range(p)]


def test_segments():
    assert alg.segments(0, 0, 4) == []
    assert alg.segments(3, 10, 4) == [(3, 7), (7, 10)]
    assert alg.segments(0, 4, 4) == [(0, 4)]


def test_counts_and_displacements_are_checked():
    assert _counts([1, 2], 2, "x") == [1, 2]
    with pytest.raises(ValueError, match="3 counts given for 2 ranks"):
        _counts([1, 2, 3], 2, "x")
    with pytest.raises(ValueError, match=">= 0"):
        _counts([1, -1], 2, "x")
    with pytest.raises(TypeError):
        _counts(5, 2, "x")
    assert _displs(None, [2, 0, 3], 5, "x") == [0, 2, 2]
    with pytest.raises(ValueError, match="outside"):
        _displs([0, 4], [2, 2], 5, "x")


@pytest.mark.parametrize("op,dtype,ok", [
    (ucxcomm.SUM, np.float16, True), (ucxcomm.PROD, np.complex64, True),
    (ucxcomm.MAX, np.complex128, False), (ucxcomm.BXOR, np.float32, False),
    (ucxcomm.BAND, np.bool_, True), (ucxcomm.LAND, np.float64, True),
    (ucxcomm.MIN, np.uint64, True), (ucxcomm.MAXLOC, np.float64, False),
    (ucxcomm.REPLACE, np.int32, False),
])
def test_buffer_ops_by_dtype(op, dtype, ok):
    arr = np.zeros(3, dtype)
    if ok:
        assert _ufunc(op, arr) is getattr(np, op.ufunc)
    else:
        with pytest.raises(TypeError):
            _ufunc(op, arr)
    with pytest.raises(TypeError, match="object collectives"):
        _ufunc(lambda a, b: a, arr)


def test_maxloc_minloc():
    assert ucxcomm.MAXLOC((3, 5), (3, 2)) == (3, 2)
    assert ucxcomm.MAXLOC((1, 0), (4, 9)) == (4, 9)
    assert ucxcomm.MINLOC((1, 7), (1, 3)) == (1, 3)
    assert ucxcomm.MINLOC((0, 7), (1, 3)) == (0, 7)


def test_in_place_is_a_singleton():
    assert repr(ucxcomm.IN_PLACE) == "ucxcomm.IN_PLACE"
    assert pickle.loads(pickle.dumps(ucxcomm.IN_PLACE)) is ucxcomm.IN_PLACE


class _FakeWorker:
    """Only what Buf needs: pointer targets of host arrays (no UCX involved)."""

    @staticmethod
    def recv_ptr(arr):
        return (arr.ctypes.data, arr.nbytes, arr, False)

    send_ptr = recv_ptr

    @staticmethod
    def subtarget(target, offset, nbytes):
        return (target[0] + offset, nbytes, target[2], False)


def test_scratch_pool_reuses_and_caps():
    worker = _FakeWorker()
    like = alg.Buf(worker, np.zeros(4, np.float32), True)
    pool = alg.ScratchPool(limit=1000)
    a = pool.take(worker, like, 100)
    assert a.arr.dtype == np.float32 and a.n == 100
    pool.give([a])
    assert pool.take(worker, like, 100) is a  # reused
    assert pool.take(worker, like, 100) is not a  # the pool is empty again
    big = pool.take(worker, like, 1000)  # 4000 bytes > limit: not kept
    pool.give([big])
    assert pool.take(worker, like, 1000) is not big
    part = a.part(10, 20)
    assert part[0] == a.target[0] + 40 and part[1] == 40


def test_every_collective_is_declared_once_with_its_tiers():
    """``COLLECTIVES`` lists every public collective of ``Comm`` (which inherits them from
    ``Collectives``: no forwarders), each blocking one a coroutine with a keyword-only
    ``timeout=None`` and a docstring, each ``I*`` form a plain method returning a
    Request; every tier a row names exists (the compiled tier's methods as
    ``comm/_fast.pyi`` declares them: tests/test_api.py keeps that stub equal to the
    module)."""
    import ast
    import inspect
    from pathlib import Path

    from ucxcomm.comm.collectives import COLLECTIVES, Collectives
    from ucxcomm.comm.small import SmallCollectives

    assert issubclass(ucxcomm.Comm, Collectives)
    stub = ast.parse((Path(ucxcomm.__file__).parent / "comm" / "_fast.pyi").read_text())
    compiled = {f.name for c in stub.body if isinstance(c, ast.ClassDef)
                and c.name == "FastCollectives" for f in c.body
                if isinstance(f, ast.FunctionDef)}
    listed = set()
    for row in COLLECTIVES:
        method = getattr(ucxcomm.Comm, row.name)
        assert inspect.iscoroutinefunction(method), row.name
        assert method.__doc__, row.name
        param = inspect.signature(method).parameters.get("timeout")
        assert param is not None and param.kind is param.KEYWORD_ONLY, row.name
        assert param.default is None, row.name
        listed.add(row.name)
        if row.nonblocking:
            nb = getattr(ucxcomm.Comm, row.nonblocking)
            assert not inspect.iscoroutinefunction(nb), row.nonblocking
            listed.add(row.nonblocking)
        if row.compiled:
            assert row.compiled in compiled, row
        if row.small:
            assert callable(getattr(SmallCollectives, row.small)), row
        for fn in row.general:
            assert callable(getattr(alg, fn, None) or getattr(Collectives, fn)), row
    public = {n for n, v in vars(Collectives).items()
              if not n.startswith("_") and callable(v) and n != "Ibarrier"}
    assert public == listed, public ^ listed
    assert ucxcomm.Comm.Ibarrier is ucxcomm.Comm.ibarrier
    # No forwarders: Comm defines none of the collectives itself.
    from ucxcomm.comm.communicator import Comm

    assert not public & set(vars(Comm)), public & set(vars(Comm))


def test_tag_fields_round_trip():
    """A received tag's communicator and source, as the split rendezvous names a sender
    by them (``World._split_sender``): every kind, the split bit, the extreme values."""
    from ucxcomm import tags

    for cid in (0, 1, tags.MAX_CID):
        for kind in (tags.KIND_P2P, tags.KIND_SPLIT, tags.KIND_COLL, tags.KIND_FRAMES):
            for source in (0, 5, tags.MAX_RANKS - 1):
                for tag in (0, 7, tags.TAG_UB):
                    t = tags.make_tag(cid, kind, source, tag)
                    for value in (t, t | tags.SPLIT_BIT):
                        assert tags.cid_of(value) == cid
                        assert tags.split_tag(value) == (source, tag)
                        ctx, mask = tags.context_of(cid)
                        assert value & mask == ctx

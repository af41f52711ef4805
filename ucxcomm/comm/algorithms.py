"""Collective algorithms on flat, typed buffers (host numpy or GPU cupy arrays).

Each algorithm is one small coroutine over a :class:`Chan` (the private tag space of one
collective call) and :class:`Buf` views. Element counts and offsets are in elements of
the buffer's dtype. Large messages move in segments of :data:`SEGMENT_BYTES` so that
receiving segment *k+1* overlaps reducing or forwarding segment *k*.

Reduction order is fixed by the algorithm, never by arrival order, so every rank gets
bit-identical results: recursive doubling always puts the lower ranks' partial result
on the left; ring and tree algorithms reduce each element on exactly one rank and
then distribute it.

This module never touches UCX: it posts tag sends/receives through the communicator's
:class:`~ucxcomm.comm.group.Group` (its transport and endpoints, typed by
:mod:`ucxcomm.transport.base`); tags come from :mod:`ucxcomm.tags`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TruncationError
from ..tags import FULL_MASK, KIND_COLL, make_tag, with_source
from . import fingerprint

if TYPE_CHECKING:
    from ..transport.base import Target, Transport
    from .group import Group

__all__ = ["TUNING", "Buf", "Chan", "ScratchPool"]

#: Algorithm switch points and segment sizes (bytes); change them to experiment.
TUNING = {
    "segment": 1 << 20,  # pipelining unit for host buffers
    "segment_gpu": 4 << 20,  # and for GPU buffers
    "allreduce_ring_min": 64 << 10,  # below: recursive doubling; above: ring
    "bcast_chain_min": 512 << 10,  # from here, at 3 ranks or more: a pipelined chain
    # the chain's segments: the message over (this many x (ranks - 1)) pieces, within
    # [bcast_chain_seg_min, segment] bytes (its pipeline fills in (p - 2) segments)
    "bcast_chain_pieces": 32,
    "bcast_chain_seg_min": 32 << 10,
    # where every rank is on a host of its own: the chain from this many bytes, with
    # segments of at least bcast_chain_seg_min_hosts below bcast_chain_min (8 hosts x
    # 200 Mbit/s, Bcast 64 KiB / 256 KiB: the binomial tree 31.7 / 30.2 % of the link,
    # the chain with 16 KiB segments 93.9 / 94.7 %, with 8 KiB 93.6 / 94.3 %)
    "bcast_chain_min_hosts": 64 << 10,
    "bcast_chain_seg_min_hosts": 16 << 10,
    # from here (bytes of the whole vector), where a communicator spans two hosts or
    # more and some host holds two of its ranks or more: Allreduce, Allgather(v) and
    # Reduce_scatter(_block) in three phases (within each host, across hosts between
    # one leader per host, within each host again), so the links between hosts carry
    # each host's bytes once instead of each rank's (1 << 62: never)
    "hier_min": 64 << 10,
    # Bytes per message (Bcast, Allreduce: the buffer; the others: one rank's block) up
    # to which the node's shared-memory engine (comm/shm.py) serves each collective,
    # from the small paths' SMALL_MAX up; above, UCX's single-copy rendezvous (CMA)
    # wins (measured at 2 ranks, docs/benchmarks.md).
    "shm_max_Bcast": 1 << 62,
    "shm_max_Allreduce": 4 << 20,
    "shm_max_Allgather": 1 << 62,
    "shm_max_Alltoall": 1 << 62,
    "shm_max_Reduce_scatter_block": 1 << 62,
    "shm_max_Reduce": 4 << 20,
    "shm_max_Gather": 1 << 62,
    "shm_max_Scatter": 1 << 62,
    # from here (bytes per message) Bcast, Allgather and Alltoall read straight out of
    # the writer's buffer (process_vm_readv) where every member can
    "shm_direct_min": 32 << 10,
    # from here (bytes per message, single-copy mode) a Bcast root and a Gather's
    # other ranks write a share of their readers' bytes into the readers' buffers
    # (process_vm_writev) while the readers read the rest: both sides copy (0: never)
    "shm_push_min": 32 << 10,
    # from here (bytes), at 4 ranks or more, an Allreduce on the engine takes two stages
    # (reduce-scatter, then allgather) where its count splits into equal blocks
    "shm_allreduce_stages_min": 0,
    # and a Reduce (reduce-scatter, then a gather to the root; below it the root's fold
    # of every piece was faster at 4 ranks on 2 cores: 64 KiB 21 us against 72-77 us)
    "shm_reduce_stages_min": 256 << 10,
    # ranks outnumber cores (spinners yield): reductions above this take the ring. It
    # was 1 MiB while a waiter that had spent 5 ms in a call polled every 0.5 ms even as
    # pieces kept moving (Reduce_scatter_block 64 MiB at 4 ranks on 2 cores took 3.5x
    # MPICH's time); waiters now poll slowly only once nothing moved for 5 ms
    "shm_max_fold_crowded": 1 << 62,
    # Alltoall(v) across hosts with blocks (the largest one sent) in [min, max) bytes:
    # this many pairwise steps in flight, not all at once (0: never). 8 hosts x 200
    # Mbit/s, Alltoall 1 MiB (128 KiB blocks), two runs each: one step at a time 80.5 and
    # 88.5 % of the link, all at once 56.6 and 65.2 %; 2 MiB and more, all at once won
    # (74 against 68 %, 72 against 61 %, 78 against 53 % at 16 MiB); 256 KiB: 95 % both.
    # Session 13, steps paired by XOR (below) against shifted, 8 hosts: 512 KiB 95.3 x3
    # against 51.7-95.3 %, 1 MiB 82.9-95.4 (five runs) against 65.5-82.1 %
    "alltoall_pairs": 1,
    "alltoall_pairs_min": 64 << 10,
    "alltoall_pairs_max": 256 << 10,
    "alltoall_pairs_xor": 1,  # power-of-two sizes: step s exchanges with rank ^ s
}


class Buf:
    """A flat typed array (numpy or cupy) and the transport target of its memory."""

    __slots__ = ("_sub", "arr", "device", "itemsize", "n", "target")

    def __init__(self, worker: Transport, arr: Any, writable: bool) -> None:
        self.arr = arr
        self.n = int(arr.size)
        self.itemsize = int(arr.itemsize)
        self.device = not isinstance(arr, np.ndarray)
        self.target = worker.recv_ptr(arr) if writable else worker.send_ptr(arr)
        self._sub = worker.subtarget

    def part(self, lo: int, hi: int) -> Target:
        """Transport target of elements ``[lo, hi)``."""
        isz = self.itemsize
        return self._sub(self.target, lo * isz, (hi - lo) * isz)

    def scratch(self, worker: Transport, n: int) -> Buf:
        """A new writable buffer of ``n`` elements of the same dtype and memory kind."""
        if self.device:
            import cupy

            return Buf(worker, cupy.empty(n, dtype=self.arr.dtype), True)
        return Buf(worker, np.empty(n, dtype=self.arr.dtype), True)


class ScratchPool:
    """Scratch buffers kept between collectives (per process): a fresh large allocation
    page-faults while data arrives into it, which cost more than the transfer itself."""

    def __init__(self, limit: int = 256 << 20) -> None:
        self.limit = limit
        self._free: dict[tuple[bool, str, int], list[Buf]] = {}
        self._bytes = 0

    def take(self, worker: Transport, like: Buf, n: int) -> Buf:
        got = self._free.get((like.device, like.arr.dtype.str, n))
        if got:
            buf = got.pop()
            self._bytes -= buf.n * buf.itemsize
            return buf
        return like.scratch(worker, n)

    def give(self, bufs: Iterable[Buf]) -> None:
        for buf in bufs:
            nbytes = buf.n * buf.itemsize
            if self._bytes + nbytes <= self.limit:
                self._free.setdefault((buf.device, buf.arr.dtype.str, buf.n), []).append(buf)
                self._bytes += nbytes

    def clear(self) -> None:
        self._free.clear()
        self._bytes = 0


class Chan:
    """The messages of one collective call (tag: communicator, collective kind, seq).

    Messages between one pair within a call are matched in posting order, so an
    algorithm only has to post its receives in the order the peer posts its sends.
    """

    __slots__ = ("_group", "_pool", "_rtag", "_stag", "fp", "rank", "recvs", "scratches",
                 "sends", "seq", "size", "sync", "what", "worker")

    def __init__(self, group: Group, seq: int, what: str = "collective") -> None:
        self._group = group
        self.what = what  # the collective's name, for errors
        self.worker = group.transport
        self.rank, self.size = group.rank, group.size
        self._stag = make_tag(group.cid, KIND_COLL, group.rank, seq)
        self._rtag = make_tag(group.cid, KIND_COLL, 0, seq)
        self.seq = seq
        self.recvs: list[asyncio.Future] = []
        self.sends: list[asyncio.Future] = []
        self.sync: Callable[[], None] | None = None  # set for GPU buffers
        #: This rank's fingerprint of the call (checks on, general form: :meth:`check`).
        self.fp: bytes | None = None
        self._pool: ScratchPool = group.scratch
        self.scratches: list[Buf] = []

    async def check(self, fp: bytes) -> None:
        """The general form's round of fingerprints (:mod:`ucxcomm.comm.fingerprint`),
        before any data moves: ``fp`` (this rank's call) to every other rank as this
        call's first message to it, and every other rank's first message received into
        scratch; then every rank holds every call and all go on, or all raise
        :class:`~ucxcomm.CollectiveMismatch` (every message of the round consumed)."""
        size, rank = self.size, self.rank
        if size == 1:
            return
        g, t = self._group, self.worker
        cap = fingerprint.capacity(size)
        rows = np.empty((size, cap), np.uint8)
        rt = t.recv_ptr(rows)
        st = t.send_ptr(fp)
        for q in range(size):
            if q != rank:
                self.send(q, st)
        got: list[Any] = [None] * size
        for q in range(size):  # (each waits in place first: the others' are on the way)
            if q != rank:
                got[q] = t.recv_into(t.subtarget(rt, q * cap, cap), with_source(self._rtag, q),
                                     FULL_MASK, g.peers_all, None, True)
                if not isinstance(got[q], tuple):
                    self.recvs.append(got[q])
        fps: list[bytes] = []
        same = True
        for q in range(size):
            if q == rank:
                fps.append(fp)
                continue
            res = got[q]
            if not isinstance(res, tuple):
                res = await t.complete(res)
            fps.append(rows[q, :min(res[1], cap)].tobytes())
            same = same and fps[-1] == fp
        await self.waitall(self.sends)
        self.recvs.clear()
        self.sends.clear()
        if same and len(fp) == fingerprint.HDR:
            return  # (every rank made this call: the verdict's rules are for the others)
        bad = fingerprint.verdict(fps, self.what, self.seq)
        if bad is not None:
            raise bad

    def scratch(self, like: Buf, n: int) -> Buf:
        """Scratch memory of ``n`` elements like ``like`` for this call (see :meth:`release`)."""
        buf = self._pool.take(self.worker, like, n)
        self.scratches.append(buf)
        return buf

    def release(self) -> None:
        """Return this call's scratch memory once no operation can touch it any more."""
        self._pool.give(self.scratches)
        self.scratches = []

    def send(self, peer: int, target: Target) -> asyncio.Future | None:
        fut = self._group.endpoint(peer).isend_raw(target, self._stag)
        if fut is not None:
            self.sends.append(fut)
        return fut

    def recv(self, peer: int, target: Target) -> asyncio.Future | None:
        # Any member's death fails the receive (not only the sender's): a collective
        # cannot complete without every member, so no rank is left waiting.
        try:
            fut = self.worker.tag_recv(target, with_source(self._rtag, peer), FULL_MASK,
                                       self._group.peers_all)
        except TruncationError as exc:  # (the message was there, and too long)
            raise self._named(exc) from None
        if fut is not None:
            self.recvs.append(fut)
        return fut

    def recv_spin(self, peer: int, target: Target) -> asyncio.Future | None:
        """Like :meth:`recv`, but wait in place (compiled, up to the spin time) for a
        message that is about to arrive: ``None`` when it did. Post the sends this rank
        owes first. For an exchange, where the peer's message comes within microseconds:
        no operation is created and no event-loop turn is taken (8 B Allreduce at 2
        ranks about 8 us instead of 11 in one A/B run; noisy)."""
        try:
            res = self.worker.recv_into(target, with_source(self._rtag, peer), FULL_MASK,
                                        self._group.peers_all, _whole, True)
            if isinstance(res, tuple):
                _whole(res)
                return None
        except TruncationError as exc:
            raise self._named(exc) from None
        self.recvs.append(res)
        return res

    async def wait(self, fut: asyncio.Future | None) -> None:
        try:
            if fut is not None and not fut.done():
                await self.worker.complete(fut)
            elif fut is not None:
                fut.result()
        except TruncationError as exc:
            raise self._named(exc) from None

    def _named(self, exc: TruncationError) -> TruncationError:
        """A message of this collective did not fit: say which collective, and the
        likely cause."""
        return TruncationError(
            f"{self.what}: a message from another rank did not fit the receive buffer "
            f"(did every rank pass the same sizes, counts and dtype?): {exc}",
            nbytes=exc.nbytes, capacity=exc.capacity)

    async def waitall(self, futs: Iterable[asyncio.Future | None]) -> None:
        pending = [f for f in futs if f is not None]
        for i, fut in enumerate(pending):
            try:
                await self.wait(fut)
            except BaseException:
                for other in pending[i + 1:]:
                    other.add_done_callback(_retrieve)
                raise

    async def guard(self, aw: Awaitable[Any]) -> Any:
        """Await ``aw`` (this call's algorithm or its waits): if it is cancelled, withdraw
        the call's receives; if it fails, consume its other operations' errors."""
        try:
            return await aw
        except asyncio.CancelledError:
            await self.withdraw()
            raise
        except BaseException:
            self.failed()
            raise

    def failed(self) -> None:
        """After an error: the call's other operations may fail too (e.g. the same
        dead peer); their errors are consumed here instead of being logged as lost."""
        for fut in self.recvs + self.sends:
            if fut.done():
                _retrieve(fut)
            else:
                fut.add_done_callback(_retrieve)

    async def withdraw(self) -> None:
        """After a cancellation: withdraw unmatched receives, let matched ones finish,
        so no buffer is written once the call has returned."""
        for fut in self.recvs:
            if not fut.done() and not self.worker.cancel(fut):
                await self.worker.settle(fut)


    def hosts(self) -> list[list[int]] | None:
        """The communicator's ranks grouped by host (each group in rank order, the groups
        in the order of their first rank) when they span two hosts or more and some
        host holds two or more of them; None otherwise (every rank knows every rank's
        host identity, so every rank gets the same answer)."""
        by = self._by_host()
        if by is None or len(by) < 2 or len(by) == self.size:
            return None
        return list(by.values())

    def spans_hosts(self) -> bool:
        """Whether the communicator's ranks are on two hosts or more (known of all)."""
        by = self._by_host()
        return by is not None and len(by) > 1

    def one_per_host(self) -> bool:
        """Whether every rank is on a host of its own (two hosts or more, known of all)."""
        by = self._by_host()
        return by is not None and len(by) == self.size > 1

    def _by_host(self) -> dict[bytes, list[int]] | None:
        g = self._group
        hosts = g.world.hosts
        if hosts is None:
            return None
        by: dict[bytes, list[int]] = {}
        for r, m in enumerate(g.members):
            h = hosts[m] if m < len(hosts) else b""
            if not h:
                return None  # (unknown: never grouped)
            by.setdefault(h, []).append(r)
        return by


class SubChan(Chan):
    """A :class:`Chan` seen through some of its ranks (``ranks``, in the sub-rank order;
    this rank among them): the hierarchical collectives run the flat algorithms on a
    host's ranks and on the hosts' leaders with the call's own tags. Messages between
    one pair still match in posting order, and each phase's pairs post in phase order.
    Only what the algorithms use is served (the call itself stays the parent's)."""

    __slots__ = ("_ch", "_ranks")

    def __init__(self, ch: Chan, ranks: Sequence[int]) -> None:  # (no Chan.__init__)
        self._ch = ch
        self._ranks = ranks
        self.rank = ranks.index(ch.rank)
        self.size = len(ranks)
        self.sync = ch.sync
        self.what = ch.what

    def hosts(self) -> list[list[int]] | None:
        return None  # (its phases are flat)

    def spans_hosts(self) -> bool:
        return False  # (not asked: no phase is an Alltoall)

    def one_per_host(self) -> bool:
        return False  # (its phases are flat)

    def send(self, peer: int, target: Target) -> asyncio.Future | None:
        return self._ch.send(self._ranks[peer], target)

    def recv(self, peer: int, target: Target) -> asyncio.Future | None:
        return self._ch.recv(self._ranks[peer], target)

    def recv_spin(self, peer: int, target: Target) -> asyncio.Future | None:
        return self._ch.recv_spin(self._ranks[peer], target)

    def scratch(self, like: Buf, n: int) -> Buf:
        return self._ch.scratch(like, n)

    async def wait(self, fut: asyncio.Future | None) -> None:
        await self._ch.wait(fut)

    async def waitall(self, futs: Iterable[asyncio.Future | None]) -> None:
        await self._ch.waitall(futs)


def _whole(result: tuple[int, int, int]) -> None:
    """A collective's message must fit its receive buffer (as UCX's posted receives
    enforce)."""
    if result[1] > result[2]:
        raise TruncationError(f"{result[1]} bytes arrived for {result[2]}",
                              nbytes=result[1], capacity=result[2])


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def segments(lo: int, hi: int, seg: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into pieces of at most ``seg`` elements (none if empty)."""
    if hi <= lo:
        return []
    return [(i, min(i + seg, hi)) for i in range(lo, hi, seg)]


def seg_elems(buf: Buf) -> int:
    nbytes = TUNING["segment_gpu"] if buf.device else TUNING["segment"]
    return max(1, nbytes // buf.itemsize)


def blocks(n: int, p: int) -> tuple[list[int], list[int]]:
    """Counts and offsets of ``n`` elements split into ``p`` near-equal blocks."""
    base, rem = divmod(n, p)
    counts = [base + (i < rem) for i in range(p)]
    displs = [0] * p
    for i in range(1, p):
        displs[i] = displs[i - 1] + counts[i - 1]
    return counts, displs


def binomial(v: int, p: int) -> tuple[int | None, list[int]]:
    """Parent and children (relative ranks, largest subtree first) of relative rank
    ``v`` in a binomial tree rooted at 0."""
    mask = 1
    parent = None
    while mask < p:
        if v & mask:
            parent = v - mask
            break
        mask <<= 1
    children = []
    m = mask >> 1
    while m > 0:
        if v + m < p:
            children.append(v + m)
        m >>= 1
    return parent, children


def _reduce_into(ch: Chan, ufunc: Any, a: Any, b: Any, out: Any) -> None:
    ufunc(a, b, out=out)
    if ch.sync is not None:
        ch.sync()


def copy(ch: Chan, dst: Any, src: Any) -> None:
    dst[...] = src
    if ch.sync is not None:
        ch.sync()


# ------------------------------------------------------------------ one to all
async def bcast(ch: Chan, buf: Buf, root: int) -> None:
    """Binomial tree; with more than two ranks large messages are forwarded segment by
    segment as they arrive. From ``TUNING["bcast_chain_min"]`` bytes at three ranks or
    more (from ``bcast_chain_min_hosts`` where every rank is on a host of its own): a
    pipelined chain.

    The tree's root sends every byte to each of its ~log2(p) children, so on a network
    its link carries log2(p) times the message (a scatter + ring allgather, which this
    replaced, about 2(p-1)/p times it). In the chain every rank receives the message
    once from the rank before it, by relative rank, and forwards each segment to the
    rank after it as it arrives: every link carries the message once, and the pipeline
    takes (p - 2) segments more to fill, so segments are cut small
    (``bcast_chain_pieces`` x (p - 1) of them, at least ``bcast_chain_seg_min``
    bytes). Across hosts the chain goes host by host (:func:`_chain_order`)."""
    p, r = ch.size, ch.rank
    if p == 1 or buf.n == 0:
        return
    v = (r - root) % p
    nbytes = buf.n * buf.itemsize
    seg_min = TUNING["bcast_chain_seg_min"]
    chain = p > 2 and nbytes >= TUNING["bcast_chain_min"]
    if (p > 2 and not chain and nbytes >= TUNING["bcast_chain_min_hosts"]
            and ch.one_per_host()):
        chain, seg_min = True, TUNING["bcast_chain_seg_min_hosts"]
    if chain:
        seg_bytes = min(max(nbytes // (TUNING["bcast_chain_pieces"] * (p - 1)), seg_min),
                        TUNING["segment_gpu"] if buf.device else TUNING["segment"])
        segs = segments(0, buf.n, max(1, seg_bytes // buf.itemsize))
        order = _chain_order(ch, root)
        v = order.index(r)
        nxt = order[(v + 1) % p]
        if v == 0:
            await ch.waitall([ch.send(nxt, buf.part(lo, hi)) for lo, hi in segs])
            return
        prev = order[v - 1]
        recvs = [ch.recv(prev, buf.part(lo, hi)) for lo, hi in segs]
        out: list[Any] = []
        for (lo, hi), fut in zip(segs, recvs, strict=True):
            await ch.wait(fut)
            if v < p - 1:
                out.append(ch.send(nxt, buf.part(lo, hi)))
        await ch.waitall(out)
        return
    if nbytes >= TUNING["hier_min"] and (groups := ch.hosts()) is not None:
        await _hier_bcast(ch, buf, root, groups)
        return
    parent, children = binomial(v, p)
    kids = [(c + root) % p for c in children]
    segs = segments(0, buf.n, seg_elems(buf)) if p > 2 else [(0, buf.n)]
    sends: list[Any] = []
    if parent is None:
        sends = [ch.send(k, buf.part(lo, hi)) for lo, hi in segs for k in kids]
    else:
        src = (parent + root) % p
        recvs = [ch.recv(src, buf.part(lo, hi)) for lo, hi in segs]
        for (lo, hi), fut in zip(segs, recvs, strict=True):
            await ch.wait(fut)
            sends.extend(ch.send(k, buf.part(lo, hi)) for k in kids)
    await ch.waitall(sends)


def _chain_order(ch: Chan, root: int) -> list[int]:
    """The chain Bcast's ranks from ``root``: by rank (``root, root + 1, ...``), or, where
    the ranks span hosts that some share (:meth:`Chan.hosts`), host by host from the
    root's (the root first, then its host's other ranks), so the chain crosses from one
    host to the next once each: hosts - 1 link crossings instead of up to ranks - 1."""
    p = ch.size
    groups = ch.hosts()
    if groups is None:
        return [(root + k) % p for k in range(p)]
    first = next(i for i, g in enumerate(groups) if root in g)
    order = [root]
    for i in range(len(groups)):
        g = groups[(first + i) % len(groups)]
        order.extend(q for q in g if q != root)
    return order


async def scatterv(ch: Chan, send: Buf | None, counts: Sequence[int],
                   displs: Sequence[int], recv: Buf | None, root: int) -> None:
    """Root sends each rank its block (``recv`` None on the root: IN_PLACE)."""
    r = ch.rank
    if r != root:
        assert recv is not None
        if counts[r]:
            await ch.wait(ch.recv(root, recv.part(0, counts[r])))
        return
    assert send is not None
    sends = [ch.send(q, send.part(displs[q], displs[q] + counts[q]))
             for q in range(ch.size) if q != root and counts[q]]
    if recv is not None and counts[r]:
        copy(ch, recv.arr[:counts[r]], send.arr[displs[r]:displs[r] + counts[r]])
    await ch.waitall(sends)


# ------------------------------------------------------------------ all to one
async def gatherv(ch: Chan, send: Buf | None, recv: Buf | None, counts: Sequence[int],
                  displs: Sequence[int], root: int) -> None:
    """Every rank sends its block to the root (``send`` None on the root: IN_PLACE)."""
    r = ch.rank
    if r != root:
        assert send is not None
        if counts[r]:
            await ch.wait(ch.send(root, send.part(0, counts[r])))
        return
    assert recv is not None
    recvs = [ch.recv(q, recv.part(displs[q], displs[q] + counts[q]))
             for q in range(ch.size) if q != root and counts[q]]
    if send is not None and counts[r]:
        copy(ch, recv.arr[displs[r]:displs[r] + counts[r]], send.arr[:counts[r]])
    await ch.waitall(recvs)


async def reduce(ch: Chan, send: Buf, recv: Buf | None, root: int, ufunc: Any) -> None:
    """Binomial tree towards ``root``, pipelined by segments; ``recv`` is used on the
    root only (it may be the same memory as ``send``: IN_PLACE)."""
    p, r, n = ch.size, ch.rank, send.n
    if p == 1 or n == 0:
        if recv is not None and recv.arr is not send.arr and n:
            copy(ch, recv.arr, send.arr)
        return
    if n * send.itemsize >= TUNING["hier_min"] and (groups := ch.hosts()) is not None:
        await _hier_reduce(ch, send, recv, root, ufunc, groups)
        return
    v = (r - root) % p
    parent, children = binomial(v, p)
    kids = [(c + root) % p for c in reversed(children)]  # nearest subtree first
    segs = segments(0, n, seg_elems(send))
    if not kids:
        await ch.waitall([ch.send((parent + root) % p, send.part(lo, hi))  # type: ignore[operator]
                          for lo, hi in segs])
        return
    acc = recv if parent is None else ch.scratch(send, n)
    assert acc is not None
    tmps = [ch.scratch(send, n) for _ in kids]
    recvs = [[ch.recv(k, t.part(lo, hi)) for lo, hi in segs]
             for k, t in zip(kids, tmps, strict=True)]
    sends = []
    for i, (lo, hi) in enumerate(segs):
        left = send.arr[lo:hi]
        for tmp, futs in zip(tmps, recvs, strict=True):
            await ch.wait(futs[i])
            _reduce_into(ch, ufunc, left, tmp.arr[lo:hi], acc.arr[lo:hi])
            left = acc.arr[lo:hi]
        if parent is not None:
            sends.append(ch.send((parent + root) % p, acc.part(lo, hi)))
    await ch.waitall(sends)


# ------------------------------------------------------------------- all to all
async def allreduce(ch: Chan, send: Buf, recv: Buf, ufunc: Any) -> None:
    """Recursive doubling for small messages, ring reduce-scatter + ring allgather
    (bandwidth-optimal) for large ones. ``send`` may be ``recv`` (IN_PLACE)."""
    n = recv.n
    if ch.size == 1 or n == 0:
        if send.arr is not recv.arr and n:
            copy(ch, recv.arr, send.arr)
        return
    if n * recv.itemsize >= TUNING["hier_min"] and (groups := ch.hosts()) is not None:
        await _hier_allreduce(ch, send, recv, ufunc, groups)
        return
    if n * recv.itemsize < TUNING["allreduce_ring_min"] or n < ch.size:
        tmp = ch.scratch(recv, n)
        await allreduce_recursive_doubling(ch, send.arr, send.target, recv.arr, recv.target,
                                           tmp.arr, tmp.target, ufunc)
        return
    counts, displs = blocks(n, ch.size)
    await ring_reduce_scatter(ch, send, recv, counts, displs, ufunc, into_recv=True)
    await ring_allgatherv(ch, recv, counts, displs)


# ------------------------------------------------------------ across hosts
def _my_host(ch: Chan, groups: list[list[int]]) -> list[int]:
    return next(g for g in groups if ch.rank in g)


def _host_blocks(ch: Chan, counts: Sequence[int], displs: Sequence[int],
                 nbytes: int) -> list[list[int]] | None:
    """The host groups (:meth:`Chan.hosts`) when a call of ``nbytes`` bytes in all
    takes the hierarchical path: from ``TUNING["hier_min"]``, and only where each
    host's ranks are consecutive and so are their blocks (one region per host)."""
    if nbytes < TUNING["hier_min"]:
        return None
    groups = ch.hosts()
    if groups is None:
        return None
    for g in groups:
        if g != list(range(g[0], g[-1] + 1)):
            return None
        if any(displs[q + 1] != displs[q] + counts[q] for q in g[:-1]):
            return None
    return groups


async def _hier_allreduce(ch: Chan, send: Buf, recv: Buf, ufunc: Any,
                          groups: list[list[int]]) -> None:
    """Allreduce across hosts in three phases: each host's ranks reduce to its first
    rank (the leader), the leaders allreduce among themselves (the ring), each leader
    broadcasts to its host. Every host's link carries the vector about twice, against
    about twice per rank of that host for the flat ring; the result is still the same
    bytes on every rank (the leaders' ring fixes one order)."""
    mine = _my_host(ch, groups)
    leader = ch.rank == mine[0]
    local = SubChan(ch, mine) if len(mine) > 1 else None
    if local is not None:
        await reduce(local, send, recv if leader else None, 0, ufunc)
    elif send.arr is not recv.arr:
        copy(ch, recv.arr, send.arr)
    if leader:
        await allreduce(SubChan(ch, [g[0] for g in groups]), recv, recv, ufunc)
    if local is not None:
        await bcast(local, recv, 0)


def _rooted_leaders(groups: list[list[int]], root: int) -> list[int]:
    """One leader per host for a rooted call: the root on its host, the first rank on
    every other."""
    return [root if root in g else g[0] for g in groups]


async def _hier_bcast(ch: Chan, buf: Buf, root: int, groups: list[list[int]]) -> None:
    """Bcast across hosts below the chain's size: the root to one leader per host (the
    flat Bcast among the leaders), then each leader within its host: the links carry
    the message once per host it reaches, where the rank tree sent it across up to
    once per rank."""
    mine = _my_host(ch, groups)
    leaders = _rooted_leaders(groups, root)
    lead = leaders[groups.index(mine)]
    if ch.rank == lead:
        await bcast(SubChan(ch, leaders), buf, leaders.index(root))
    if len(mine) > 1:
        await bcast(SubChan(ch, mine), buf, mine.index(lead))


async def _hier_reduce(ch: Chan, send: Buf, recv: Buf | None, root: int, ufunc: Any,
                       groups: list[list[int]]) -> None:
    """Reduce across hosts: within each host to its leader (the root on the root's
    host), then the leaders to the root (the flat tree among them): the links carry the
    vector once per host instead of once per tree edge that crosses."""
    r = ch.rank
    mine = _my_host(ch, groups)
    leaders = _rooted_leaders(groups, root)
    lead = leaders[groups.index(mine)]
    src = send
    if len(mine) > 1:
        acc = (recv if r == root else ch.scratch(send, send.n)) if r == lead else None
        await reduce(SubChan(ch, mine), send, acc, mine.index(lead), ufunc)
        if acc is not None:
            src = acc
    if r == lead:
        await reduce(SubChan(ch, leaders), src, recv if r == root else None,
                     leaders.index(root), ufunc)


async def allgatherv(ch: Chan, buf: Buf, counts: Sequence[int], displs: Sequence[int],
                     own: Buf | None = None) -> None:
    """:func:`ring_allgatherv`, or across hosts (:func:`_host_blocks`) three phases:
    each host's blocks gathered by its leader, the hosts' regions ring-allgathered
    among the leaders, the whole buffer broadcast within each host."""
    groups = _host_blocks(ch, counts, displs, sum(counts) * buf.itemsize)
    if groups is None:
        await ring_allgatherv(ch, buf, counts, displs, own)
        return
    r = ch.rank
    mine = _my_host(ch, groups)
    leader = r == mine[0]
    mine_blk = buf.part(displs[r], displs[r] + counts[r])
    if leader:
        futs = [ch.recv(q, buf.part(displs[q], displs[q] + counts[q]))
                for q in mine[1:] if counts[q]]
        if own is not None and counts[r]:
            copy(ch, buf.arr[displs[r]:displs[r] + counts[r]], own.arr[:counts[r]])
        await ch.waitall(futs)
        hcounts = [sum(counts[q] for q in g) for g in groups]
        await ring_allgatherv(SubChan(ch, [g[0] for g in groups]), buf, hcounts,
                              [displs[g[0]] for g in groups])
    elif counts[r]:
        await ch.wait(ch.send(mine[0], own.part(0, counts[r]) if own is not None else mine_blk))
    if len(mine) > 1:
        await bcast(SubChan(ch, mine), buf, 0)


async def reduce_scatter(ch: Chan, send: Buf, out: Buf, counts: Sequence[int],
                         displs: Sequence[int], ufunc: Any) -> None:
    """:func:`ring_reduce_scatter` into ``out`` (block ``r`` only), or across hosts
    (:func:`_host_blocks`) three phases: each host's ranks reduce the whole vector to
    the leader, the leaders reduce-scatter it by host region (ring), each leader
    scatters its region's blocks within its host."""
    groups = _host_blocks(ch, counts, displs, send.n * send.itemsize)
    if groups is None:
        await ring_reduce_scatter(ch, send, out, counts, displs, ufunc, into_recv=False)
        return
    r = ch.rank
    mine = _my_host(ch, groups)
    leader = r == mine[0]
    local = SubChan(ch, mine) if len(mine) > 1 else None
    acc = ch.scratch(send, send.n) if leader else None
    if local is not None:
        await reduce(local, send, acc, 0, ufunc)
    if acc is not None:
        await ring_reduce_scatter(SubChan(ch, [g[0] for g in groups]),
                                  acc if local is not None else send, acc,
                                  [sum(counts[q] for q in g) for g in groups],
                                  [displs[g[0]] for g in groups], ufunc, into_recv=True)
    if local is not None:
        await scatterv(local, acc, [counts[q] for q in mine], [displs[q] for q in mine],
                       out, 0)
    elif acc is not None and counts[r]:
        copy(ch, out.arr[:counts[r]], acc.arr[displs[r]:displs[r] + counts[r]])


async def allreduce_recursive_doubling(ch: Chan, send: Any, send_target: Any, recv: Any,
                                       recv_target: Any, tmp: Any, tmp_target: Any,
                                       ufunc: Any) -> None:
    """Recursive doubling: the result lands in ``recv`` (``send`` may be the same array:
    in place); ``tmp`` is scratch of the same shape. Arrays and transport targets are
    passed as they are (no :class:`Buf`): this is the small-message path, where every
    microsecond shows. The first exchange sends ``send`` itself and reduces straight
    into ``recv``, so no copy is needed.

    Non-powers of two: the first ``2*rem`` ranks pair up; the even one hands its data to
    the odd one and gets the result back at the end."""
    p, r = ch.size, ch.rank
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    cur, cur_target = send, send_target
    if r < 2 * rem:
        if r % 2 == 0:
            await ch.wait(ch.send(r + 1, send_target))
            await ch.wait(ch.recv(r + 1, recv_target))
            return
        await ch.wait(ch.recv(r - 1, tmp_target))
        _reduce_into(ch, ufunc, tmp, send, recv)
        cur, cur_target = recv, recv_target
        newrank = r // 2
    else:
        newrank = r - rem
    mask = 1
    while mask < pof2:
        newdst = newrank ^ mask
        dst = newdst * 2 + 1 if newdst < rem else newdst + rem
        sfut = ch.send(dst, cur_target)  # (an exchange: send first, then wait in place)
        await ch.wait(ch.recv_spin(dst, tmp_target))
        await ch.wait(sfut)
        if dst < r:
            _reduce_into(ch, ufunc, tmp, cur, recv)
        else:
            _reduce_into(ch, ufunc, cur, tmp, recv)
        cur, cur_target = recv, recv_target
        mask <<= 1
    if r < 2 * rem:
        await ch.wait(ch.send(r - 1, recv_target))


async def ring_reduce_scatter(ch: Chan, send: Buf, out: Buf, counts: Sequence[int],
                              displs: Sequence[int], ufunc: Any, *,
                              into_recv: bool) -> None:
    """Ring reduce-scatter: after ``p - 1`` steps rank ``r`` holds block ``r`` reduced.

    ``into_recv``: ``out`` has the full layout and every partial result is written to
    its block there (allreduce); otherwise ``out`` holds block ``r`` only and partial
    results go through two alternating scratch buffers (reduce-scatter). Each segment
    is forwarded as soon as it is reduced.
    """
    p, r = ch.size, ch.rank
    right, left = (r + 1) % p, (r - 1) % p
    seg = seg_elems(send)
    biggest = max(counts)
    tmp = ch.scratch(send, biggest)
    accs = [] if into_recv else [ch.scratch(send, biggest) for _ in range(2)]

    def dest(b: int, s: int) -> tuple[Buf, int]:
        if into_recv:
            return out, displs[b]
        if b == r:
            return out, 0
        return accs[s % 2], 0

    b0 = (r - 1) % p
    posted: list[list[Any]] = [[ch.send(right, send.part(displs[b0] + lo, displs[b0] + hi))
                                for lo, hi in segments(0, counts[b0], seg)]]
    for s in range(p - 1):
        b = (r - s - 2) % p
        if s >= 2:  # the sends that read this step's scratch buffer two steps ago
            await ch.waitall(posted[s - 1])
        segs = segments(0, counts[b], seg)
        recvs = [ch.recv(left, tmp.part(lo, hi)) for lo, hi in segs]
        target, off = dest(b, s)
        nxt: list[Any] = []
        for (lo, hi), fut in zip(segs, recvs, strict=True):
            await ch.wait(fut)
            _reduce_into(ch, ufunc, tmp.arr[lo:hi], send.arr[displs[b] + lo:displs[b] + hi],
                         target.arr[off + lo:off + hi])
            if s < p - 2:
                nxt.append(ch.send(right, target.part(off + lo, off + hi)))
        posted.append(nxt)
    for futs in posted:
        await ch.waitall(futs)


async def ring_allgatherv(ch: Chan, buf: Buf, counts: Sequence[int],
                          displs: Sequence[int], own: Buf | None = None) -> None:
    """Ring allgather into ``buf``; each segment is forwarded as soon as it arrives.

    Rank ``r``'s block is sent from ``own`` when given (and copied into place while the
    first messages travel), else it is already at ``displs[r]``."""
    p, r = ch.size, ch.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    # Segments only pay off where blocks are forwarded (more than two ranks).
    seg = seg_elems(buf) if p > 2 else max(counts)
    src = own if own is not None else buf
    off = 0 if own is not None else displs[r]
    sends = [ch.send(right, src.part(off + lo, off + hi))
             for lo, hi in segments(0, counts[r], seg)]
    for s in range(p - 1):
        b = (r - s - 1) % p
        segs = segments(displs[b], displs[b] + counts[b], seg)
        recvs = [ch.recv(left, buf.part(lo, hi)) for lo, hi in segs]
        if s == 0 and own is not None and counts[r]:
            copy(ch, buf.arr[displs[r]:displs[r] + counts[r]], own.arr[:counts[r]])
        for (lo, hi), fut in zip(segs, recvs, strict=True):
            await ch.wait(fut)
            if s < p - 2:
                sends.append(ch.send(right, buf.part(lo, hi)))
    await ch.waitall(sends)


async def alltoallv(ch: Chan, send: Buf, scounts: Sequence[int], sdispls: Sequence[int],
                    recv: Buf, rcounts: Sequence[int], rdispls: Sequence[int]) -> None:
    """Pairwise exchange: all receives posted first, then sends to ``r+1, r+2, ...``;
    across hosts, with blocks of ``alltoall_pairs_min`` to ``alltoall_pairs_max`` bytes,
    ``alltoall_pairs`` steps at a time (:func:`_alltoallv_pairs`: step ``s`` exchanges
    with ``r ^ s`` at a power of two ranks, else sends to ``r+s`` and receives from
    ``r-s``). Each rank chooses by its own largest block (an Alltoallv's ranks may
    choose differently): either way each pair exchanges one message per direction, and
    a rank that posts everything at once never waits for a step, so mixed schedules
    complete."""
    p, r = ch.size, ch.rank
    w = TUNING["alltoall_pairs"]
    big = max(scounts) * send.itemsize
    if (0 < w < p - 1 and TUNING["alltoall_pairs_min"] <= big < TUNING["alltoall_pairs_max"]
            and ch.spans_hosts()):
        await _alltoallv_pairs(ch, w, send, scounts, sdispls, recv, rcounts, rdispls)
        return
    recvs = []
    for s in range(1, p):
        q = (r - s) % p
        if rcounts[q]:
            recvs.append(ch.recv(q, recv.part(rdispls[q], rdispls[q] + rcounts[q])))
    sends = []
    for s in range(1, p):
        q = (r + s) % p
        if scounts[q]:
            sends.append(ch.send(q, send.part(sdispls[q], sdispls[q] + scounts[q])))
    if scounts[r]:
        copy(ch, recv.arr[rdispls[r]:rdispls[r] + rcounts[r]],
             send.arr[sdispls[r]:sdispls[r] + scounts[r]])
    await ch.waitall(recvs)
    await ch.waitall(sends)


async def _alltoallv_pairs(ch: Chan, w: int, send: Buf, scounts: Sequence[int],
                           sdispls: Sequence[int], recv: Buf, rcounts: Sequence[int],
                           rdispls: Sequence[int]) -> None:
    """:func:`alltoallv` with ``w`` steps in flight: each rank receives from ``w`` peers
    at a time (all of them at once flood a host's link from p - 1 senders). With a power
    of two ranks, step ``s`` pairs rank ``r`` with ``r ^ s`` both ways (the pairs of a
    step are disjoint: one rank late holds up its partner alone, where the shift
    ``r+s`` / ``r-s`` chains every rank of a step behind it)."""
    p, r = ch.size, ch.rank
    steps: list[tuple[Any, Any]] = []
    xor = TUNING["alltoall_pairs_xor"] and p & (p - 1) == 0

    def post(s: int) -> None:
        q, d = (r ^ s, r ^ s) if xor else ((r - s) % p, (r + s) % p)
        rf = ch.recv(q, recv.part(rdispls[q], rdispls[q] + rcounts[q])) if rcounts[q] else None
        sf = ch.send(d, send.part(sdispls[d], sdispls[d] + scounts[d])) if scounts[d] else None
        steps.append((rf, sf))

    for s in range(1, min(w, p - 1) + 1):
        post(s)
    if scounts[r]:
        copy(ch, recv.arr[rdispls[r]:rdispls[r] + rcounts[r]],
             send.arr[sdispls[r]:sdispls[r] + scounts[r]])
    for s in range(1, p):
        await ch.waitall(steps[s - 1])
        if s + w < p:
            post(s + w)


async def scan(ch: Chan, send: Buf, recv: Buf, ufunc: Any, exclusive: bool) -> None:
    """Recursive doubling prefix reduction; lower ranks' data always on the left.

    ``exclusive``: rank 0's ``recv`` is left untouched (its value is undefined, as in
    MPI). ``send`` may be ``recv`` (IN_PLACE).
    """
    p, r, n = ch.size, ch.rank, send.n
    if n == 0:
        return
    partial = ch.scratch(send, n)
    copy(ch, partial.arr, send.arr)
    if not exclusive and send.arr is not recv.arr:
        copy(ch, recv.arr, send.arr)
    tmp = ch.scratch(send, n)
    have = not exclusive  # whether recv holds a value yet
    mask = 1
    while mask < p:
        dst = r ^ mask
        if dst < p:
            rfut = ch.recv(dst, tmp.part(0, n))
            sfut = ch.send(dst, partial.part(0, n))
            await ch.wait(rfut)
            await ch.wait(sfut)
            if dst < r:
                _reduce_into(ch, ufunc, tmp.arr, partial.arr, partial.arr)
                if have:
                    _reduce_into(ch, ufunc, tmp.arr, recv.arr, recv.arr)
                else:
                    copy(ch, recv.arr, tmp.arr)
                    have = True
            else:
                _reduce_into(ch, ufunc, partial.arr, tmp.arr, partial.arr)
        mask <<= 1

"""``Win``: one-sided windows over a communicator (mpi4py's names, awaitable).

Every rank exposes a memory region; ``Put``/``Get``/``Accumulate``/``Fetch_and_op``/
``Compare_and_swap`` reach any rank's region without its CPU taking part (on RDMA; over
TCP and shared memory the target's RMA progress thread serves them, see
:mod:`ucxcomm.transport.rma`). Windows are open for access from creation to ``Free()``.

Atomicity (MPI: accumulates are atomic element-wise with respect to each other):

* 32/64-bit integer elements with ``SUM``, ``BAND``, ``BOR``, ``BXOR``, ``REPLACE``,
  ``NO_OP``, and ``Compare_and_swap`` on them, use UCX's remote atomics, element by element.
* Every other op/dtype (floats, ``MIN``/``MAX``/``PROD``...) runs get-op-put under a
  per-target accumulate lock (itself a remote atomic), so those are atomic with respect
  to each other. Mixing the two groups on the same location concurrently is not atomic
  (MPI's ``accumulate_ops=same_op_no_op``); one op per location is always safe.

Passive-target locks (``Lock``/``Unlock``) are a reader-writer lock word per rank, also
taken with remote atomics.

Every blocking call takes ``timeout=`` (seconds; None: no limit) and raises
:class:`~ucxcomm.CommTimeoutError` when it runs out. Waits for a remote lock (``Lock``,
the accumulate lock of non-native accumulates) give up between attempts, so no lock is
left taken; a data movement that timed out may still read its origin buffer until the
next ``Flush`` of that rank; a ``Fence``, ``Free`` or creation that timed out leaves the
communicator's collectives out of step (it takes no further collective). ``async with``
frees the window at the end (``abort()`` when the block raised).

Memory is registered and reached through the communicator's transport
(:class:`~ucxcomm.transport.base.Transport`: ``register`` gives a ``Region``,
``remote_memory`` a ``Remote``); nothing else of the transport is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._buffers import typed_flat
from .._deadline import NEVER, Deadline, check_timeout, within
from ..errors import ClosedError, CommTimeoutError, PeerFailure, WindowError
from . import trace
from .collectives import _ufunc
from .ops import BAND, BOR, BXOR, NO_OP, REPLACE, SUM, Op

if TYPE_CHECKING:  # annotations only: importing ucxcomm must not load the transport
    from ..transport.base import Region, Remote
    from .communicator import Comm

__all__ = ["Win"]

_CTRL_WORDS = 2  # [0]: passive-target lock, [1]: accumulate lock
# The lock word: shared holders count in the low 40 bits; an exclusive holder sets
# _EXCL and puts its rank above it (so waiters can tell who holds it, and fail with
# PeerFailure when that rank dies instead of waiting forever).
_EXCL = 1 << 40
_HOLDER_SHIFT = 41
_SHARED_MASK = _EXCL - 1
_INT_AMO = {np.dtype(t) for t in (np.int32, np.uint32, np.int64, np.uint64)}
_NATIVE = {SUM: "add", BAND: "and", BOR: "or", BXOR: "xor", REPLACE: "swap"}
_ndarray = np.ndarray
_FOP = {**_NATIVE, NO_OP: "add"}  # Fetch_and_op's remote atomic per op (NO_OP: add 0)
_INT_AMO_KEYS: dict[Any, int] = {}
for _t in (np.int32, np.uint32, np.int64, np.uint64):
    _INT_AMO_KEYS[_t] = _INT_AMO_KEYS[np.dtype(_t)] = np.dtype(_t).itemsize


#: Longest stretch of window calls that complete without waiting (shared memory: copies
#: and CPU atomics) before Lock/Unlock/Flush let the event loop run once. Without it a
#: loop of such calls never yielded: the store's death notices were never read, so a
#: Lock/Put/Unlock loop on a dead rank's (still mapped) memory went on forever, deaf to
#: timeouts too (issue 15, fault suite). A round trip costs microseconds, once per 1 ms.
YIELD_S = 1e-3
_monotonic = time.monotonic


# Win._counts[rank]: what this rank issued to ``rank`` (Win.stats).
_PUTS, _PUT_BYTES, _GETS, _GET_BYTES, _ATOMICS, _ATOMIC_BYTES, _FLUSHES = range(7)
_COUNTED = ("puts", "put_bytes", "gets", "get_bytes", "atomics", "atomic_bytes", "flushes")


def _native(op: Op, dt: np.dtype) -> bool:
    return dt in _INT_AMO and (op in _NATIVE or op is NO_OP)


async def _backoff(attempt: int) -> None:
    """Pause between attempts at a contended remote lock (yield first, then sleep a
    little longer each time, up to 1 ms)."""
    await asyncio.sleep(0 if attempt < 4 else min(1e-3, 1e-5 * 2 ** min(attempt - 4, 7)))


class Win:
    """A window: every rank's exposed memory, reachable by all (create with
    :meth:`Allocate` or :meth:`Create`; collective)."""

    comm: Comm
    memory: Any  # this rank's exposed buffer
    disp_unit: int
    _ctrl: np.ndarray
    _region: Region
    _ctrl_region: Region
    _mem: list[Remote]  # every rank's window
    _ctl: list[Remote]  # every rank's control words
    _units: list[int]
    _held: dict[int, bool]
    _counts: list[list[int]]  # per target rank, indexed by _PUTS...

    def __init__(self) -> None:  # use Allocate/Create
        self._closed = True
        self._yield_at = 0.0  # when a synchronization call next lets the loop run

    # ------------------------------------------------------------ creation
    @classmethod
    async def Allocate(cls, comm: Comm, nbytes: int, disp_unit: int = 1, *,
                       timeout: float | None = None) -> Win:
        """Collective: allocate ``nbytes`` (zeroed) on every rank and expose them.
        ``win.memory`` is this rank's part (a writable numpy uint8 array, valid until
        :meth:`Free`). The memory comes from UCX, shared-memory capable: ranks on the same
        host put, get and update it directly (like MPICH's shared-memory windows), without
        the target's help."""
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        return await cls._make(comm, None, disp_unit, nbytes,
                               deadline=Deadline(timeout, "Win.Allocate"))

    @classmethod
    async def Create(cls, comm: Comm, buf: Any, disp_unit: int = 1, *,
                     timeout: float | None = None) -> Win:
        """Collective: expose ``buf`` (a writable, contiguous buffer) on every rank."""
        typed_flat(buf, writable=True, what="Win.Create buffer")  # checks, no I/O
        return await cls._make(comm, buf, disp_unit,
                               deadline=Deadline(timeout, "Win.Create"))

    @classmethod
    async def _make(cls, comm: Comm, buf: Any, disp_unit: int, nbytes: int = 0,
                    deadline: Deadline = NEVER) -> Win:
        """``buf`` None: allocate ``nbytes`` through the transport."""
        transport = comm.group.transport
        if type(disp_unit) is not int or disp_unit < 1:
            raise ValueError(f"disp_unit must be an int >= 1, got {disp_unit!r}")
        self = cls()
        self.comm = comm
        self.disp_unit = disp_unit
        # The control words (locks) are taken with remote atomics by every rank: UCX's
        # shared-memory capable memory lets peers on this host do them directly.
        self._ctrl_region = transport.allocate(_CTRL_WORDS * 8)
        self._ctrl = self._ctrl_region.memory.view(np.int64)
        if buf is None:
            self._region = transport.allocate(nbytes)
            self.memory = self._region.memory
        else:
            self._region = transport.register(buf)
            self.memory = buf
        mine = (self._region.rkey, self._region.address, self._region.nbytes,
                self._ctrl_region.rkey, self._ctrl_region.address, disp_unit)
        try:
            infos = await comm.allgather(mine, timeout=deadline.left())
        except BaseException:
            self._region.close()
            self._ctrl_region.close()
            raise
        # Labelled with the owner's world rank: a wait on a dead rank's memory raises
        # PeerFailure (UCX may never finish it).
        owners = comm.group.members
        self._mem = [transport.remote_memory(i[0], i[1], i[2], owners[r])
                     for r, i in enumerate(infos)]
        self._ctl = [transport.remote_memory(i[3], i[4], _CTRL_WORDS * 8, owners[r])
                     for r, i in enumerate(infos)]
        self._units = [i[5] for i in infos]
        # Every rank finishes connecting to every other before anyone goes on: UCX
        # aborts a process that receives connection setup from a peer that died
        # meanwhile (seen in CI: a rank dying right after creating a window).
        for rm in self._ctl:  # (the data keys use the same endpoints)
            await deadline.wait(rm.wireup())
        await comm.barrier(timeout=deadline.left())
        self._held = {}  # rank -> exclusive?
        self._counts = [[0] * len(_COUNTED) for _ in infos]
        comm.group.windows.append(weakref.ref(self))
        self._closed = False
        return self

    async def _let_loop_run(self) -> None:
        """Yield to the event loop once (death notices, timeouts, other tasks); callers
        come here when ``_yield_at`` has passed (:data:`YIELD_S`)."""
        self._yield_at = _monotonic() + YIELD_S
        await asyncio.sleep(0)

    def _check(self, rank: Any) -> int:
        if self._closed:
            raise ClosedError("the window was freed")
        if self.comm.group.closed:
            self.comm.group.check_open()  # (its communicator closed or revoked)
        if type(rank) is not int or not 0 <= rank < len(self._mem):
            raise ValueError(f"target rank {rank!r} is out of range for a window over "
                             f"{len(self._mem)} ranks")
        return rank

    def _origin(self, buf: Any, writable: bool, what: str) -> np.ndarray:
        return typed_flat(buf, writable=writable, what=what)

    def _offset(self, rank: int, disp: Any, nbytes: int, what: str) -> int:
        if type(disp) is not int:
            raise TypeError(f"{what}: target_disp must be an int, got {disp!r}")
        off = disp * self._units[rank]
        if disp < 0 or off + nbytes > self._mem[rank].nbytes:
            raise WindowError(f"{what}: {nbytes} bytes at displacement {disp} (x "
                              f"{self._units[rank]}) fall outside rank {rank}'s "
                              f"{self._mem[rank].nbytes}-byte window")
        return off

    # ------------------------------------------------------------ data movement
    async def Put(self, origin: Any, target_rank: int, target_disp: int = 0, *,
                  timeout: float | None = None) -> None:
        """Write ``origin`` into ``target_rank``'s window at ``target_disp``; returns when
        ``origin`` may be reused (visible at the target after Flush/Unlock/Fence)."""
        if timeout is not None:
            check_timeout(timeout, "Put")
            return await within(self.Put(origin, target_rank, target_disp), timeout,
                                      "Put")
        r = self._check(target_rank)
        if type(origin) is _ndarray and origin.flags.c_contiguous and \
                not origin.dtype.hasobject:
            arr = origin  # the common case, checked in one line
        else:
            arr = self._origin(origin, False, "Put origin")
        off = self._offset(r, target_disp, arr.nbytes, "Put")
        c = self._counts[r]
        c[_PUTS] += 1
        c[_PUT_BYTES] += arr.nbytes
        await self._mem[r].put(arr, off)

    async def Get(self, origin: Any, target_rank: int, target_disp: int = 0, *,
                  timeout: float | None = None) -> None:
        """Read ``len(origin)`` bytes of ``target_rank``'s window into ``origin``."""
        if timeout is not None:
            check_timeout(timeout, "Get")
            return await within(self.Get(origin, target_rank, target_disp), timeout,
                                      "Get")
        r = self._check(target_rank)
        if type(origin) is _ndarray and origin.flags.c_contiguous and \
                origin.flags.writeable and not origin.dtype.hasobject:
            arr = origin
        else:
            arr = self._origin(origin, True, "Get origin")
        off = self._offset(r, target_disp, arr.nbytes, "Get")
        c = self._counts[r]
        c[_GETS] += 1
        c[_GET_BYTES] += arr.nbytes
        await self._mem[r].get(arr, off)

    async def Accumulate(self, origin: Any, target_rank: int, target_disp: int = 0,
                         op: Op = SUM, *, timeout: float | None = None) -> None:
        """``target = op(target, origin)`` element-wise, atomically per element."""
        await self._accumulate(origin, None, target_rank, target_disp, op,
                               Deadline(timeout, "Accumulate"))

    async def Get_accumulate(self, origin: Any, result: Any, target_rank: int,
                             target_disp: int = 0, op: Op = SUM, *,
                             timeout: float | None = None) -> None:
        """Like :meth:`Accumulate`, and ``result`` receives the previous target values."""
        await self._accumulate(origin, result, target_rank, target_disp, op,
                               Deadline(timeout, "Get_accumulate"))

    async def _accumulate(self, origin: Any, result: Any, target_rank: int,
                          target_disp: int, op: Op, deadline: Deadline) -> None:
        what = deadline.what
        r = self._check(target_rank)
        if not isinstance(op, Op) or (op.ufunc is None and op not in (REPLACE, NO_OP)):
            raise TypeError(f"{what}: op must be an element-wise ucxcomm.Op, got {op!r}")
        src = self._origin(origin, False, f"{what} origin")
        dt = src.dtype
        res = None
        if result is not None:
            res = self._origin(result, True, f"{what} result")
            if res.dtype != dt or res.size != src.size:
                raise ValueError(f"{what}: result must match origin ({src.size} x {dt})")
        if op.ufunc is not None:
            _ufunc(op, src)  # op/dtype check before any I/O
        off = self._offset(r, target_disp, src.nbytes, what)
        self._count_atomic(r, src.nbytes)
        if _native(op, dt):  # one remote atomic per element, all in flight together
            values = [0] * src.size if op is NO_OP else src.tolist()
            olds = await within(
                self._mem[r].atomic_many(_FOP[op], values, off, dt, fetch=res is not None),
                deadline.left(), what)
            if res is not None:
                res[...] = olds
            return
        await self._locked_update(r, off, src, res, op, deadline)

    @contextlib.asynccontextmanager
    async def _acc_lock(self, r: int, deadline: Deadline) -> AsyncIterator[Remote]:
        """Hold rank ``r``'s accumulate lock (a remote CAS spin lock); yields its memory.
        Updates made inside are flushed before the lock is released. ``deadline`` is
        checked between attempts (never inside one: a lock won must be known)."""
        ctl, mem = self._ctl[r], self._mem[r]
        attempt = 0
        mine = self.comm.rank + 1  # the holder, so that waiters see when it dies
        while (old := await ctl.atomic("cswap", mine, 8, np.int64, compare=0)) != 0:
            deadline.check()
            if self._dead(r):
                raise PeerFailure(f"accumulate: rank {r} died", peer=r)
            if 0 < old <= len(self._mem) and self._dead(old - 1):
                raise PeerFailure(f"accumulate: rank {old - 1} died holding rank {r}'s "
                                  "accumulate lock", peer=old - 1)
            await _backoff(attempt)
            attempt += 1
        try:
            yield mem
            await mem.flush()
        finally:
            await ctl.atomic("swap", 0, 8, np.int64)
            await ctl.flush()

    async def _locked_update(self, r: int, off: int, src: np.ndarray, res: Any,
                             op: Op, deadline: Deadline) -> None:
        """get-op-put under rank ``r``'s accumulate lock (atomic w.r.t. the others)."""
        async with self._acc_lock(r, deadline) as mem:
            cur = np.empty_like(src)
            await mem.get(cur, off)
            if res is not None:
                res[...] = cur
            if op is REPLACE:
                new = src
            elif op is NO_OP:
                return
            else:
                new = getattr(np, op.ufunc)(cur, src)  # type: ignore[arg-type]
                new = np.asarray(new, dtype=src.dtype)
            await mem.put(new, off)

    async def Fetch_and_op(self, value: Any, target_rank: int, target_disp: int = 0,
                           op: Op = SUM, dtype: Any = np.int64, *,
                           timeout: float | None = None) -> Any:
        """Apply ``op`` with ``value`` to one element; returns the previous value."""
        amo = _FOP.get(op) if dtype in _INT_AMO_KEYS else None
        if amo is not None and timeout is None:  # the common case: one remote atomic
            r = self._check(target_rank)
            size = _INT_AMO_KEYS[dtype]
            off = self._offset(r, target_disp, size, "Fetch_and_op")
            c = self._counts[r]
            c[_ATOMICS] += 1
            c[_ATOMIC_BYTES] += size
            return await self._mem[r].atomic(amo, 0 if op is NO_OP else value, off, dtype)
        deadline = Deadline(timeout, "Fetch_and_op")
        if amo is not None:
            return await within(self.Fetch_and_op(value, target_rank, target_disp, op,
                                                  dtype), timeout, "Fetch_and_op")
        dt = np.dtype(dtype)
        src = np.array([value], dtype=dt)
        res = np.empty(1, dtype=dt)
        await self._accumulate(src, res, target_rank, target_disp, op, deadline)
        return res[0].item()

    async def Compare_and_swap(self, value: Any, compare: Any, target_rank: int,
                               target_disp: int = 0, dtype: Any = np.int64, *,
                               timeout: float | None = None) -> Any:
        """Write ``value`` if the element equals ``compare``; returns the old value."""
        deadline = NEVER if timeout is None else Deadline(timeout, "Compare_and_swap")
        r = self._check(target_rank)
        dt = np.dtype(dtype)
        off = self._offset(r, target_disp, dt.itemsize, "Compare_and_swap")
        self._count_atomic(r, dt.itemsize)
        if dt in _INT_AMO:
            op = self._mem[r].atomic("cswap", value, off, dt, compare=compare)
            if timeout is None:  # the common case: no wrapper around the one atomic
                return await op
            return await within(op, timeout, "Compare_and_swap")
        src = np.array([value], dtype=dt)
        res = np.empty(1, dtype=dt)
        async with self._acc_lock(r, deadline) as mem:
            await mem.get(res, off)
            if res[0] == np.array(compare, dtype=dt):
                await mem.put(src, off)
        return res[0].item()

    # ------------------------------------------------------------ synchronization
    async def Flush(self, rank: int, *, timeout: float | None = None) -> None:
        """Complete, at ``rank``, every operation this rank issued to it.

        Raises
        ------
        PeerFailure
            ``rank`` died (what was issued to it may not have landed).
        CommTimeoutError
        """
        r = self._check(rank)
        if timeout is not None:
            check_timeout(timeout, "Flush")
        if _monotonic() >= self._yield_at:
            await self._let_loop_run()
        if self._dead(r):
            raise PeerFailure(f"Flush: rank {r} died", peer=r)
        self._counts[r][_FLUSHES] += 1
        if timeout is None:  # the common case: no wrapper (Put + Flush is the latency)
            await self._mem[r].flush()
        else:
            await within(self._mem[r].flush(), timeout, "Flush")

    async def Flush_all(self, *, timeout: float | None = None) -> None:
        """:meth:`Flush` every rank."""
        deadline = Deadline(timeout, "Flush_all")
        for r in range(len(self._mem)):
            await self.Flush(r, timeout=deadline.left())

    async def Fence(self, *, timeout: float | None = None) -> None:
        """Complete all of this rank's operations, then synchronize all ranks
        (collective: one that timed out leaves the communicator's collectives out of
        step)."""
        deadline = Deadline(timeout, "Fence")
        with self._recorded("Win.Fence", None):
            await self.Flush_all(timeout=deadline.left())
            await self.comm.barrier(timeout=deadline.left())

    async def Lock(self, rank: int, exclusive: bool = True, *,
                   timeout: float | None = None) -> None:
        """Passive-target lock on ``rank`` (exclusive: alone; shared: with other shared
        holders). Waits while it is held incompatibly.

        Raises
        ------
        PeerFailure
            ``rank`` died, or a rank that holds its lock (or may: shared holders are
            not named) died while this one waited.
        CommTimeoutError
            Still held by others after ``timeout`` seconds (checked between attempts:
            the lock is not taken).
        """
        deadline = Deadline(timeout, "Lock")
        r = self._check(rank)
        if r in self._held:
            raise RuntimeError(f"rank {r} is already locked by this rank")
        if _monotonic() >= self._yield_at:
            await self._let_loop_run()
        if self._dead(r):  # (its memory may still be mapped here: the lock would "work")
            raise PeerFailure(f"Lock: rank {r} died", peer=r)
        ctl = self._ctl[r]
        attempt = 0
        with self._recorded("Win.Lock", r):
            if exclusive:
                mine = _EXCL | self.comm.rank << _HOLDER_SHIFT
                while (old := await ctl.atomic("cswap", mine, 0, np.int64, compare=0)) != 0:
                    self._check_holders(r, old, "Lock")
                    deadline.check()
                    await _backoff(attempt)
                    attempt += 1
            else:
                while True:
                    old = await ctl.atomic("add", 1, 0, np.int64)
                    if not old & _EXCL:
                        break
                    await ctl.atomic("add", -1, 0, np.int64, fetch=False)
                    self._check_holders(r, old, "Lock")
                    deadline.check()
                    await _backoff(attempt)
                    attempt += 1
        self._held[r] = exclusive

    def _recorded(self, kind: str, r: int | None) -> contextlib.AbstractContextManager[None]:
        """The flight record (``comm/trace.py``) of synchronization ``kind`` with rank
        ``r`` (None: all), ended as the block ends."""
        g = self.comm.group
        rec = g.world.recorder
        peer = -2 if r is None else r
        return trace.recorded(rec, rec.start(kind, trace.WAITING, g.cid, g.rank, g.size,
                                             -1, peer, -2 if r is None else g.members[r]))

    def _dead(self, rank: int) -> bool:
        group = self.comm.group
        return group.transport.is_dead(group.members[rank])

    def _check_holders(self, r: int, word: int, what: str) -> None:
        """While waiting for rank ``r``'s lock (``word``: what the lock word held): raise
        PeerFailure if the target died, or a holder did (the exclusive holder is named
        in the word; shared holders are not, so any dead member counts)."""
        if self._dead(r):
            raise PeerFailure(f"{what}: rank {r}, the lock's target, died", peer=r)
        if word & _EXCL:
            holder = word >> _HOLDER_SHIFT
            if 0 <= holder < len(self._mem) and self._dead(holder):
                raise PeerFailure(f"{what}: rank {holder} died holding the lock on rank "
                                  f"{r}", peer=holder)
        if word & _SHARED_MASK or not word & _EXCL:
            for q in range(len(self._mem)):
                if self._dead(q):
                    raise PeerFailure(f"{what}: rank {q} died while the lock on rank {r} "
                                      "was held (it may have been a holder)", peer=q)

    async def Unlock(self, rank: int, *, timeout: float | None = None) -> None:
        """Complete this rank's operations at ``rank`` and release the lock.

        Raises
        ------
        PeerFailure
            ``rank`` died (what was issued to it may not have landed); the lock is
            released here all the same.
        CommTimeoutError
            The release did not complete within ``timeout`` seconds (it goes on: this
            rank no longer holds the lock).
        """
        if timeout is not None:
            check_timeout(timeout, "Unlock")
        r = self._check(rank)
        if r not in self._held:
            raise RuntimeError(f"rank {r} is not locked by this rank")
        if _monotonic() >= self._yield_at:
            await self._let_loop_run()  # (before anything changes: cancelled here, still held)
        exclusive = self._held.pop(r)
        if self._dead(r):
            raise PeerFailure(f"Unlock: rank {r} died", peer=r)
        # Shielded: once this rank has forgotten the lock, a cancellation of the caller
        # must not leave the lock word set at the target (every other rank would spin).
        with self._recorded("Win.Unlock", r):
            await within(asyncio.shield(self._release(r, exclusive)), timeout, "Unlock")

    async def _release(self, r: int, exclusive: bool) -> None:
        self._counts[r][_FLUSHES] += 1
        await self._mem[r].flush()
        ctl = self._ctl[r]
        mine = _EXCL | self.comm.rank << _HOLDER_SHIFT if exclusive else 1
        await ctl.atomic("add", -mine, 0, np.int64, fetch=False)
        await ctl.flush()

    async def Lock_all(self, *, timeout: float | None = None) -> None:
        """Shared lock on every rank (one that times out releases those it took)."""
        deadline = Deadline(timeout, "Lock_all")
        taken = []
        try:
            for r in range(len(self._mem)):
                await self.Lock(r, exclusive=False, timeout=deadline.left())
                taken.append(r)
        except CommTimeoutError:
            for r in taken:
                await self.Unlock(r)
            raise

    async def Unlock_all(self, *, timeout: float | None = None) -> None:
        """Unlock every rank this rank holds locked (all of them, also when one raises
        ``PeerFailure``: the first such error is raised at the end)."""
        deadline = Deadline(timeout, "Unlock_all")
        failure: PeerFailure | None = None
        for r in list(self._held):
            try:
                await self.Unlock(r, timeout=deadline.left())
            except PeerFailure as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    @contextlib.asynccontextmanager
    async def lock(self, rank: int, exclusive: bool = True) -> AsyncIterator[Win]:
        """``async with win.lock(rank):`` -- Lock ... Unlock."""
        await self.Lock(rank, exclusive)
        try:
            yield self
        finally:
            await self.Unlock(rank)

    @contextlib.asynccontextmanager
    async def fence_epoch(self) -> AsyncIterator[Win]:
        """``async with win.fence_epoch():`` -- Fence before and after."""
        await self.Fence()
        yield self
        await self.Fence()

    async def Free(self, *, timeout: float | None = None) -> None:
        """Collective: wait for every rank, then release the registrations (released
        also when the wait fails or times out; a timeout leaves the communicator's
        collectives out of step). On a revoked communicator, or one with a member known
        dead, it releases this rank's part at once, without waiting (as :meth:`abort`)."""
        if self._closed:
            return
        g = self.comm.group
        if g.revoked is not None or self.comm.failed():
            # (revoked or with a dead member: no collective can complete; this rank's
            # part is released, locally, as docs/elastic.md says)
            self.abort()
            return
        deadline = Deadline(timeout, "Free")
        try:
            await self.Flush_all(timeout=deadline.left())
            await self.comm.barrier(timeout=deadline.left())
        finally:
            self.abort()

    def abort(self) -> None:
        """Release this rank's part at once, without waiting for the others (safe in
        ``finally``; other ranks' operations on it fail). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for rm in self._mem + self._ctl:
            rm.close()
        self._region.close()
        self._ctrl_region.close()

    async def __aenter__(self) -> Win:
        return self

    async def __aexit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            await self.Free()
        else:
            self.abort()

    def transport_info(self) -> dict[int, list[tuple[str, str]]]:
        """The UCX (transport, device) lanes that carry this window's one-sided traffic
        to each rank (the RMA engines' endpoints; see docs/transports.md).

        Raises
        ------
        ClosedError
            The window was freed.
        """
        if self._closed:
            raise ClosedError("the window was freed")
        return {r: mem.transports() for r, mem in enumerate(self._mem)}

    def _count_atomic(self, r: int, nbytes: int) -> None:
        c = self._counts[r]
        c[_ATOMICS] += 1
        c[_ATOMIC_BYTES] += nbytes

    def stats(self) -> dict[str, Any]:
        """What this rank issued on this window, in total and per target rank: a plain
        dict ``{"size", "freed", "puts", "put_bytes", "gets", "get_bytes", "atomics",
        "atomic_bytes", "flushes", "targets": {rank: {the same counts}}}``.

        Calls are counted once their arguments are checked (one that then fails or
        times out counts too). ``atomics``: ``Accumulate``, ``Get_accumulate``,
        ``Fetch_and_op`` and ``Compare_and_swap`` calls (bytes: the origin's), however
        they are carried out (remote atomics element by element, or get-op-put under
        the target's accumulate lock, whose own traffic is not counted). ``flushes``:
        flushes of a target's memory: each ``Flush``, one per rank for ``Flush_all``,
        ``Fence`` and ``Free``, and each ``Unlock``'s. ``Lock``/``Unlock``'s lock-word
        atomics are not counted. Readable after :meth:`Free`.
        """
        counts = getattr(self, "_counts", [])
        targets = {r: dict(zip(_COUNTED, c, strict=True)) for r, c in enumerate(counts)}
        total = {k: sum(t[k] for t in targets.values()) for k in _COUNTED}
        return {"size": len(counts), "freed": self._closed, **total, "targets": targets}

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "freed" if self._closed else f"{len(self._mem)} ranks"
        return f"<ucxcomm.Win {state}>"


"""``Collectives``: the collective operations of a communicator, over its ``Group``.

:class:`~ucxcomm.Comm` *is* a :class:`Collectives` (its base class: the collectives are
``Comm``'s own methods, no forwarding layer). :data:`COLLECTIVES` lists every collective
and the tiers that serve it: a compiled small-message call (``comm/_fast.pyx``), the
Python small-message path (``comm/small.py``), the general algorithms
(``comm/algorithms.py``); on one host, the mid-size calls of Bcast, Allgather, Alltoall,
Allreduce and Reduce_scatter_block, and Gather, Scatter and Reduce, take the node's
shared-memory engine (``comm/shm.py``) before the general algorithms. Lowercase methods
move Python objects, Capitalized ones move buffers (numpy arrays, bytearray/memoryview,
cupy arrays on the GPU) without staging copies; ``barrier`` lives here too. Each
blocking collective ``X`` takes ``timeout=`` and awaits ``_X(...)``, which checks the
arguments and starts the operation (an awaitable, or ``DONE`` when it finished in the
call); ``IX`` wraps the same start in a :class:`~ucxcomm.Request`. Every argument is
checked before a collective takes its sequence number, so a bad call raises at once on
the calling rank and leaves the communicator usable. The algorithms themselves live in
:mod:`ucxcomm.comm.algorithms`.

Non-blocking forms (``Ibcast``, ``Iallreduce``... and ``ibarrier``) start the operation
immediately and return a :class:`~ucxcomm.Request`; like MPI, every rank must start the
same collectives in the same order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .._buffers import typed_flat
from .._deadline import check_timeout, limit
from ..errors import CollectiveError, CommTimeoutError, UcxCommError
from ..tags import KIND_COLL, make_tag
from . import algorithms as alg
from . import fingerprint, trace
from .algorithms import Buf, Chan, binomial
from .ops import MAX, MIN, SUM, Op
from .request import Request
from .shm import NodeShm
from .small import DONE, SMALL_MAX, SMALL_MAX_RANKS, SmallCollectives, small_ok

if TYPE_CHECKING:
    from .group import Group

__all__ = ["COLLECTIVES", "IN_PLACE", "Collective", "Collectives"]


class _InPlace:
    """``sendbuf=IN_PLACE``: the input is taken from (and the result written to) the
    receive buffer, where MPI allows it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ucxcomm.IN_PLACE"

    def __reduce__(self) -> str:
        return "IN_PLACE"


IN_PLACE = _InPlace()

_UNMADE = object()  # Collectives._fast before the first call makes it
# The fingerprint roots of an Allreduce's two stages on the engine (a rank in one stage
# and a rank in a one-stage Allreduce, or in the other stage, do not match)
_STAGE_RS, _STAGE_AG = -3, -4
# and of a Reduce's to root k: -5 - 2k (reduce-scatter) and -6 - 2k (gather)
_STAGE_REDUCE = -5
_EMPTY = np.empty(0, np.uint8)  # a barrier's data

_checked_ops: dict[tuple[str, Any], bool] = {}
_fast_ufuncs: dict[tuple[Op, Any], Any] = {}


def _ufunc(op: Any, arr: Any) -> Any:
    """The element-wise kernel of ``op`` for ``arr``'s dtype (numpy or cupy), or a
    clear error before any I/O."""
    if not isinstance(op, Op):
        raise TypeError(f"buffer reductions take a ucxcomm.Op (SUM, MAX, ...), got "
                        f"{op!r}; user functions work with the object collectives "
                        "(comm.reduce/allreduce/scan)")
    if op.ufunc is None:
        raise TypeError(f"{op!r} has no element-wise form: use it with the object "
                        "collectives (comm.reduce, comm.allreduce, ...)")
    dtype = np.dtype(arr.dtype)
    key = (op.name, dtype)
    if key not in _checked_ops:
        ok = not (op in (MIN, MAX) and dtype.kind == "c") and not dtype.hasobject
        if ok:
            try:
                getattr(np, op.ufunc)(np.zeros(1, dtype), np.zeros(1, dtype),
                                      out=np.empty(1, dtype))
            except TypeError:
                ok = False
        _checked_ops[key] = ok
    if not _checked_ops[key]:
        if dtype.hasobject:
            raise TypeError(f"buffer reductions need numeric dtypes, not {dtype} (Python "
                            "object references); reduce objects with the lower-case API "
                            "(comm.allreduce, comm.reduce)")
        raise TypeError(f"{op!r} is not defined for dtype {dtype}")
    if isinstance(arr, np.ndarray):
        return getattr(np, op.ufunc)
    import cupy

    return getattr(cupy, op.ufunc)


def _lean_ufunc(op: Any, arr: np.ndarray) -> Any:
    """:func:`_ufunc` of a host array, cached by ``(op, dtype)`` (None: not an
    :class:`Op`, for the general path's error)."""
    if not isinstance(op, Op):
        return None
    key = (op, arr.dtype)
    ufunc = _fast_ufuncs.get(key)
    if ufunc is None:  # (raises before any sequence number is taken)
        ufunc = _fast_ufuncs[key] = _ufunc(op, arr)
    return ufunc


def _then(first: Awaitable[None], second: Callable[[], Awaitable[None]],
          after: Callable[[], None] | None = None) -> Awaitable[None]:
    """``first`` (DONE, or the rest to await), then ``second()`` (the same), then
    ``after()``: DONE when all of it finished here, else the rest."""
    res = second() if first is DONE else None
    if res is DONE or (res is not None and after is None):
        if res is DONE and after is not None:
            after()
        return res

    async def rest() -> None:
        nonlocal res
        if res is None:
            await first
            res = second()
        if res is not DONE:
            await res
        if after is not None:
            after()

    return rest()


def _counts(counts: Any, size: int, what: str) -> list[int]:
    try:
        out = [int(c) for c in counts]
    except TypeError:
        raise TypeError(f"{what}: counts must be a sequence of ints") from None
    if len(out) != size:
        raise ValueError(f"{what}: {len(out)} counts given for {size} ranks")
    if any(c < 0 for c in out):
        raise ValueError(f"{what}: counts must be >= 0, got {out}")
    return out


def _displs(displs: Any, counts: list[int], n: int, what: str) -> list[int]:
    if displs is None:
        out = [0] * len(counts)
        for i in range(1, len(counts)):
            out[i] = out[i - 1] + counts[i - 1]
    else:
        try:
            out = [int(d) for d in displs]
        except TypeError:
            raise TypeError(f"{what}: displacements must be a sequence of ints") from None
        if len(out) != len(counts):
            raise ValueError(f"{what}: {len(out)} displacements for {len(counts)} ranks")
    for c, d in zip(counts, out, strict=True):
        if d < 0 or d + c > n:
            raise ValueError(f"{what}: block [{d}, {d + c}) is outside the {n}-element "
                             "buffer")
    return out


def _equal_blocks(n: int, p: int, what: str) -> tuple[list[int], list[int]]:
    """Counts and displacements of ``n`` elements cut into ``p`` equal blocks."""
    if n % p:
        raise ValueError(f"{what}: {n} elements do not split into {p} equal blocks")
    count = n // p
    return [count] * p, [i * count for i in range(p)]


@dataclass(frozen=True)
class Collective:
    """One collective of the API and the tiers that serve it (see :data:`COLLECTIVES`)."""

    #: The blocking method (a coroutine taking ``timeout=``), e.g. ``"Allreduce"``.
    name: str
    #: Its non-blocking form (returns a :class:`~ucxcomm.Request`), if any.
    nonblocking: str | None = None
    #: Small C-contiguous host arrays, one call into compiled code: the method of
    #: ``comm/_fast.pyx``'s ``FastCollectives`` (2 to ``SMALL_MAX_RANKS`` ranks) that
    #: serves them first.
    compiled: str | None = None
    #: Small host arrays in Python, the same messages as the compiled tier (the
    #: ``I*`` forms, other ops and dtypes): the method of ``comm/small.py``'s
    #: ``SmallCollectives``.
    small: str | None = None
    #: The general algorithms (any size, any buffer), functions of ``comm/algorithms.py``
    #: (the object collectives' are methods here).
    general: tuple[str, ...] = ()


#: Every collective of :class:`~ucxcomm.Comm`, with its tiers, tried in this order:
#: compiled, small, general. The one place that lists them (tests check that each
#: named method exists and that every public collective method is listed here).
COLLECTIVES: tuple[Collective, ...] = (
    Collective("barrier", "ibarrier", general=("_run_barrier",)),
    Collective("Bcast", "Ibcast", "bcast", "bcast", ("bcast",)),
    Collective("Reduce", "Ireduce", general=("reduce",)),
    Collective("Allreduce", "Iallreduce", "allreduce", "allreduce",
               ("allreduce_recursive_doubling", "allreduce")),
    Collective("Gather", "Igather", general=("gatherv",)),
    Collective("Gatherv", "Igatherv", general=("gatherv",)),
    Collective("Scatter", "Iscatter", general=("scatterv",)),
    Collective("Scatterv", "Iscatterv", general=("scatterv",)),
    Collective("Allgather", "Iallgather", "allgather", "allgather", ("allgatherv",)),
    Collective("Allgatherv", "Iallgatherv", general=("allgatherv",)),
    Collective("Alltoall", "Ialltoall", "alltoall", "alltoall", ("alltoallv",)),
    Collective("Alltoallv", "Ialltoallv", general=("alltoallv",)),
    Collective("Reduce_scatter_block", "Ireduce_scatter_block", "reduce_scatter_block",
               "reduce_scatter_block", ("reduce_scatter",)),
    Collective("Reduce_scatter", "Ireduce_scatter", general=("reduce_scatter",)),
    Collective("Scan", "Iscan", general=("scan",)),
    Collective("Exscan", "Iexscan", general=("scan",)),
    Collective("bcast", general=("_bcast_obj",)),
    Collective("reduce", general=("_reduce_obj",)),
    Collective("allreduce", general=("_allreduce_obj", "_reduce_obj", "_bcast_obj")),
    Collective("gather", general=("_gather_obj",)),
    Collective("allgather", general=("_allgather_obj", "_gather_obj", "_bcast_obj")),
    Collective("scatter", general=("_scatter_obj",)),
    Collective("alltoall", general=("_alltoall_obj",)),
    Collective("scan", general=("_scan_obj", "_scan_steps")),
    Collective("exscan", general=("_scan_obj", "_scan_steps")),
)


class Collectives:
    """The collectives of the communicator whose :class:`~ucxcomm.comm.group.Group` is
    ``group``: the base class of :class:`~ucxcomm.Comm` (see the module docstring).

    A collective that timed out (``timeout=``) leaves the ranks' collectives out of
    step: the group then refuses every further collective at the call
    (``Group.out_of_step``, checked where a collective takes its sequence number).
    """

    __slots__ = (
        "_check_open",
        "_entry",
        "_fast",
        "_fast_ar",
        "_group",
        "_next_seq",
        "_rd_scratch",
        "_shm",
        "_small",
        "_stage_scratch",
        "_transport",
        "rank",
        "size",
    )

    def __init__(self, group: Group) -> None:
        self._group = group
        self._transport = group.transport
        self.rank = group.rank
        self.size = group.size
        self._check_open = group.check_open
        self._next_seq = group.next_seq
        # Scratch of the small-Allreduce path: (dtype, shape, array, target) or None.
        self._rd_scratch: tuple[Any, Any, Any, Any] | None = None
        # A non-root's block of a two-stage Reduce on the engine (see _shm_reduce).
        self._stage_scratch: Any = None
        self._small = SmallCollectives(group)
        # Up to SMALL_MAX_RANKS: the compiled small collectives and their Allreduce
        # (_UNMADE until the first call makes them; not a bound method of this object,
        # which would keep a dropped communicator alive until the garbage collector runs).
        self._fast: Any = _UNMADE if 2 <= self.size <= SMALL_MAX_RANKS else None
        self._fast_ar: Any = self._fast
        # The node's shared-memory engine (comm/shm.py): _UNMADE until the first call
        # that may use it, None where it cannot serve this communicator.
        self._shm: Any = _UNMADE
        # Its compiled entry for plain numpy arrays (_shm.Entry), tried first by the
        # blocking collectives it serves (None until the engine's first call).
        self._entry: Any = None

    def _small_chan(self, what: str) -> Chan:
        """A channel for a small-message path of collective ``what`` (arguments already
        checked)."""
        self._check_open()
        return Chan(self._group, self._next_seq(), what)

    # ------------------------------------------------------------- helpers
    def _buf(self, obj: Any, writable: bool, what: str) -> Buf:
        return Buf(self._transport, typed_flat(obj, writable=writable, what=what), writable)

    def _spec(self, spec: Any, writable: bool, what: str
              ) -> tuple[Buf, list[int], list[int]]:
        """``(buf, counts[, displs])`` of a v-collective."""
        if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
            raise TypeError(f"{what}: expected a (buffer, counts) or (buffer, counts, "
                            f"displacements) tuple, got {type(spec).__name__}")
        buf = self._buf(spec[0], writable, what)
        counts = _counts(spec[1], self.size, what)
        displs = _displs(spec[2] if len(spec) == 3 else None, counts, buf.n, what)
        return buf, counts, displs

    @staticmethod
    def _same(a: Buf, b: Buf, what: str, n: int | None = None) -> None:
        if a.arr.dtype != b.arr.dtype:
            raise TypeError(f"{what}: send and receive dtypes differ ({a.arr.dtype} vs "
                            f"{b.arr.dtype})")
        if a.device != b.device:
            raise ValueError(f"{what}: send and receive buffers must both be on the host "
                             "or both on the GPU")
        if n is not None and b.n != n:
            raise ValueError(f"{what}: the receive buffer has {b.n} elements, "
                             f"{n} expected")

    def _fp(self, what: str, b: Buf | None, count: int = -1, root: int = -1, op: Any = None,
            own: int = -1, vec: Sequence[int] = ()) -> bytes | None:
        """This rank's fingerprint of collective ``what`` in the general form
        (:mod:`ucxcomm.comm.fingerprint`; ``b``: the buffer whose dtype it names), or
        None when the checks are off."""
        if not self._group.check:
            return None
        return fingerprint.make(what, fingerprint.GENERAL, op, root,
                                None if b is None else b.arr.dtype, count, own, vec,
                                1 if b is not None and b.device else 0)

    def _combined(self, what: str, send: Any, recv: Any, root: int = -1, op: Any = None,
                  ufunc: Any = None, out: Any = None) -> Awaitable[None]:
        """The combined form (checks on) of a small exchange of host memory whose
        arguments are checked (flat numpy arrays; ``send`` may be ``recv``): one message
        per pair, fingerprint and data (``comm/_fast.pyx``'s ``exchange``); ``ufunc``
        folds into ``out`` a reduction the compiled code has no kernel for."""
        self._check_open()
        fast = self._fast if self._fast is not _UNMADE else self._make_fast()
        if fast is None:
            self._check_open()
            raise UcxCommError(f"{what}: no compiled collectives for this communicator")
        res = fast.exchange(what, send, recv, root, op)
        if res is DONE:
            return DONE
        return self._small.settle(res, ufunc, out)

    def _shm_start(self, what: str, nbytes: int, send: Any, recv: Any, n: int,
                   root: int = -1, op: Any = None, ufunc: Any = None, count: int = -1,
                   kind: str | None = None, fp_root: int | None = None
                   ) -> Awaitable[None] | None:
        """Start ``what`` on the node's shared-memory engine (``comm/shm.py``) when it
        serves this communicator and ``nbytes`` (per message) is in its range: DONE or
        the rest to await; None: take another path. Arguments are checked; this takes
        the sequence number. ``send``/``recv``: flat host arrays (``send`` may be
        ``recv``'s own block or all of it, in place); ``n``: bytes, as
        :class:`ucxcomm.comm._shm.Call` counts them; ``count``: the fingerprint's;
        ``kind``: the engine's collective that serves ``what`` (default: ``what``;
        a stage of a composite, whose fingerprint root ``fp_root``, default ``root``,
        tells apart)."""
        sh = self._shm
        if sh is _UNMADE:
            sh = self._shm = NodeShm(self._group) if NodeShm.usable(self._group) else None
        kind = kind or what
        if (sh is None or not sh.mins[kind] < nbytes <= alg.TUNING[sh.limits[kind]]
                or (op is not None and sh.crowded
                    and nbytes > alg.TUNING["shm_max_fold_crowded"])
                or not sh.ready()):
            return None
        if self._entry is None:
            self._entry = sh.make_entry(_lean_ufunc)
        fp = None
        if self._group.check:
            fr = root if fp_root is None else fp_root
            key = (what, fr, recv.dtype, count, op)
            fp = sh.fps.get(key)
            if fp is None:
                if len(sh.fps) > 64:
                    sh.fps.clear()
                fp = sh.fps[key] = fingerprint.make(what, fingerprint.SHM, op, fr,
                                                    recv.dtype, count)
        kernel = 0
        if op is not None:
            kernel = sh.kernels.get((op, recv.dtype), -1)
            if kernel < 0:
                from . import _fast

                if len(sh.kernels) > 64:
                    sh.kernels.clear()
                kernel = sh.kernels[op, recv.dtype] = _fast.native_kernel(op, recv.dtype)[0]
        self._check_open()
        return sh.start(what, self._next_seq(), fp, send, recv, n, root, kernel, ufunc,
                        nbytes >= alg.TUNING["shm_direct_min"], kind)

    def _shm_allreduce(self, send: Any, recv: Any, op: Any, ufunc: Any
                       ) -> Awaitable[None] | None:
        """An Allreduce of host arrays (checked) on the engine, as :meth:`_shm_start`.
        From 4 ranks and ``TUNING["shm_allreduce_stages_min"]`` bytes, when the count
        splits into equal blocks, in two stages: a reduce-scatter (each member folds
        one block of every member's input, in rank order) and an allgather of the
        folded blocks, so each member folds 1/p of the buffer instead of all of it."""
        p, nbytes = self.size, recv.nbytes
        if (p >= 4 and recv.size % p == 0
                and nbytes >= alg.TUNING["shm_allreduce_stages_min"]):
            blk = recv.size // p
            flat = recv.reshape(-1)
            mine = flat[self.rank * blk:(self.rank + 1) * blk]
            first = self._shm_start("Allreduce", mine.nbytes, send, mine, mine.nbytes,
                                    -1, op, ufunc, count=recv.size,
                                    kind="Reduce_scatter_block", fp_root=_STAGE_RS)
            if first is not None:
                return self._allreduce_stage2(first, flat, mine)
        return self._shm_start("Allreduce", nbytes, send, recv, nbytes, op=op, ufunc=ufunc,
                               count=recv.size)

    def _shm_reduce(self, send: Any, recv: Any, op: Any, ufunc: Any, root: int
                    ) -> Awaitable[None] | None:
        """A Reduce of host arrays (checked; ``recv`` None off the root) on the engine,
        as :meth:`_shm_start`. From 4 ranks and ``TUNING["shm_reduce_stages_min"]``
        bytes, when the count splits into equal blocks, in two stages, as MPICH's
        reduce-scatter + gather: each member folds one block of every member's input,
        then the root gathers the folded blocks (its own is already in place), instead
        of the root folding all of it."""
        p, r, nbytes = self.size, self.rank, send.nbytes
        if (p >= 4 and send.size % p == 0
                and nbytes >= alg.TUNING["shm_reduce_stages_min"]):
            blk = send.size // p
            flat = None
            if r == root:
                flat = recv.reshape(-1)
                mine = flat[r * blk:(r + 1) * blk]
            else:
                cache = self._stage_scratch
                if cache is not None and cache.dtype == send.dtype and cache.size == blk:
                    mine, self._stage_scratch = cache, None  # (a concurrent call: its own)
                else:
                    mine = np.empty(blk, send.dtype)
            first = self._shm_start("Reduce", mine.nbytes, send, mine, mine.nbytes, -1, op,
                                    ufunc, count=send.size, kind="Reduce_scatter_block",
                                    fp_root=_STAGE_REDUCE - 2 * root)
            if first is not None:
                return self._reduce_stage2(first, flat, mine, root)
            if flat is None:
                self._stage_scratch = mine
        return self._shm_start("Reduce", nbytes, send, send if recv is None else recv, nbytes,
                               root, op, ufunc, count=send.size)

    def _reduce_stage2(self, first: Awaitable[None], flat: Any, mine: Any, root: int
                       ) -> Awaitable[None]:
        """After a Reduce's reduce-scatter stage ``first`` (DONE, or its rest): the
        gather to ``root`` (``flat``: its output; None elsewhere, ``mine`` scratch)."""

        def second() -> Awaitable[None]:
            res = self._shm_start("Reduce", mine.nbytes, mine, mine if flat is None else flat,
                                  mine.nbytes, root, count=mine.size * self.size,
                                  kind="Gather", fp_root=_STAGE_REDUCE - 1 - 2 * root)
            if res is None:  # (the first stage's size fits the second's range)
                raise UcxCommError("Reduce: the engine refused its second stage")
            return res

        def keep() -> None:
            self._stage_scratch = mine

        return _then(first, second, keep if flat is None else None)

    def _allreduce_stage2(self, first: Awaitable[None], flat: Any, mine: Any
                          ) -> Awaitable[None]:
        """After the reduce-scatter stage ``first`` (DONE, or its rest): the allgather."""

        def second() -> Awaitable[None]:
            res = self._shm_start("Allreduce", mine.nbytes, mine, flat, mine.nbytes,
                                  count=flat.size, kind="Allgather", fp_root=_STAGE_AG)
            if res is None:  # (the first stage's size fits the second's range)
                raise UcxCommError("Allreduce: the engine refused its second stage")
            return res

        return _then(first, second)

    def _chan(self, what: str, *bufs: Buf | None, fp: bytes | None = None) -> Chan:
        """A fresh collective channel (takes the next sequence number: call only once
        every argument is checked); ``fp``: this rank's fingerprint (:meth:`_fp`),
        checked before the algorithm runs."""
        self._check_open()
        ch = Chan(self._group, self._next_seq(), what)
        ch.fp = fp
        if any(b is not None and b.device for b in bufs):
            import cupy

            stream = cupy.cuda.get_current_stream()
            ch.sync = stream.synchronize
        return ch

    async def _check(self, ch: Chan) -> None:
        """Call ``ch``'s round of fingerprints (the general form of
        :mod:`ucxcomm.comm.fingerprint`): compiled where this communicator has its
        compiled collectives, else :meth:`Chan.check`."""
        assert ch.fp is not None
        fast = self._fast if self._fast is not _UNMADE else self._make_fast()
        if fast is None:
            return await ch.guard(ch.check(ch.fp))
        res = fast.check_round(ch.fp, ch.seq, ch.what)
        if res is not DONE:
            await self._small.settle(res)

    async def _run(self, ch: Chan, coro: Awaitable[None]) -> None:
        if ch.sync is not None:
            ch.sync()  # kernels that produced the inputs have finished
        try:
            if ch.fp is not None:
                try:
                    await self._check(ch)
                except BaseException:
                    close = getattr(coro, "close", None)
                    if close is not None:
                        close()  # (never started)
                    raise
            await ch.guard(coro)
        except asyncio.CancelledError:
            ch.release()  # (withdrawn: nothing touches the scratch any more)
            raise
        # (on failure, operations may still be pending: their scratch is dropped)
        ch.release()

    @staticmethod
    def _request(coro: Awaitable[Any]) -> Request:
        return Request(asyncio.ensure_future(coro))

    def _traced(self, res: Any, what: str, root: Any = None, posted: bool = False,
                seq: int | None = None) -> Awaitable[Any]:
        """Await ``res``, collective ``what``'s rest (or DONE: the compiled call
        finished and recorded it), with its flight record (``comm/trace.py``): ``seq``
        defaults to the sequence number the call just took, read now (a posted call's
        task starts later, maybe after further calls took theirs)."""
        return self._traced_wait(res, what, root, posted,
                                 self._group.last_seq if seq is None else seq)

    async def _traced_wait(self, res: Any, what: str, root: Any, posted: bool,
                           seq: int) -> Any:
        if res is DONE:
            return None
        g = self._group
        rec = g.world.recorder
        peer = root if type(root) is int and 0 <= root < self.size else -2
        token = rec.start(what, trace.POSTED if posted else trace.WAITING, g.cid, self.rank,
                          self.size, seq, peer,
                          g.members[peer] if peer >= 0 else -2)
        try:  # (inline, not trace.follow: one coroutine less on every call that waits)
            out = await res
        except BaseException as exc:
            trace.ended(rec, token, exc)
            raise
        rec.end(token)
        return out

    # ============================================================== buffers
    async def Bcast(self, buf: Any, root: int = 0, *, timeout: float | None = None) -> None:
        """Broadcast ``buf`` from ``root`` into ``buf`` on every rank: on one host, the
        node's shared-memory engine above 8 KiB (``comm/shm.py``); otherwise a binomial
        tree, segmented for large messages, or a pipelined chain from 512 KiB at 3 ranks
        or more (every link carries the message once)."""
        if timeout is not None:
            return await self._deadline(self._Bcast, (buf, root), timeout, "Bcast")
        res = self._Bcast(buf, root)
        if res is not DONE:
            await self._traced(res, "Bcast", root)

    def _Bcast(self, buf: Any, root: int = 0) -> Awaitable[None]:
        """Start :meth:`Bcast` (checks first): what to await, or DONE."""
        if self._entry is not None and (res := self._entry.bcast(buf, root)) is not None:
            return cast(Awaitable[None], res)
        pair = self._fast if self._fast is not _UNMADE else self._make_fast()
        if pair is not None:
            rest = pair.bcast(buf, root)
            if rest is not None:
                return rest if rest is DONE else self._small.wait_rest(rest, "Bcast")
        return self._bcast(buf, root)

    def _bcast(self, buf: Any, root: int) -> Awaitable[None]:
        root = self._group.check_peer(root, "root")
        if (type(buf) is np.ndarray and buf.nbytes > SMALL_MAX and buf.flags.c_contiguous
                and (self.rank == root or buf.flags.writeable) and not buf.dtype.hasobject
                and (res := self._shm_start("Bcast", buf.nbytes, buf, buf, buf.nbytes, root,
                                            count=buf.size))):
            return res
        if self._group.check:
            b = self._buf(buf, self.rank != root, "Bcast buffer")
            if not b.device and self._small.usable(b.arr.nbytes):
                return self._combined("Bcast", b.arr, b.arr, root)
            if not b.device and (res := self._shm_start("Bcast", b.arr.nbytes, b.arr, b.arr,
                                                        b.arr.nbytes, root, count=b.n)):
                return res  # (another kind of host buffer: the engine all the same)
            ch = self._chan("Bcast", b, fp=self._fp("Bcast", b, b.n, root))
            return self._run(ch, alg.bcast(ch, b, root))
        if (small_ok(buf) and self._small.usable(buf.nbytes)
                and (self.rank == root or buf.flags.writeable)):
            return self._small.bcast(self._small_chan("Bcast"), buf, root)
        b = self._buf(buf, self.rank != root, "Bcast buffer")
        if not b.device and (res := self._shm_start("Bcast", b.arr.nbytes, b.arr, b.arr,
                                                    b.arr.nbytes, root, count=b.n)):
            return res
        ch = self._chan("Bcast", b)
        return self._run(ch, alg.bcast(ch, b, root))

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        """Non-blocking :meth:`Bcast`."""
        return self._request(self._traced(
            self._bcast(buf, root), "Bcast", root, posted=True))

    async def Reduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, root: int = 0, *,
                     timeout: float | None = None) -> None:
        """Element-wise reduction of every rank's ``sendbuf`` into ``recvbuf`` at
        ``root`` (``recvbuf`` may be None elsewhere; ``sendbuf=IN_PLACE`` at the root)."""
        if timeout is not None:
            return await self._deadline(self._Reduce, (sendbuf, recvbuf, op, root),
                                        timeout, "Reduce")
        res = self._Reduce(sendbuf, recvbuf, op, root)
        if res is not DONE:
            await self._traced(res, "Reduce", root)

    def _Reduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, root: int = 0) -> Awaitable[None]:
        """Start :meth:`Reduce` (checks first): what to await, or DONE."""
        if (self._entry is not None
                and (res := self._entry.reduce(sendbuf, recvbuf, op, root)) is not None):
            return cast(Awaitable[None], res)
        root = self._group.check_peer(root, "root")
        if (self._shm is not None and small_ok(sendbuf)
                and (self.rank != root or (small_ok(recvbuf) and recvbuf.flags.writeable
                                           and recvbuf.dtype == sendbuf.dtype
                                           and recvbuf.size == sendbuf.size))
                and (ufunc := _lean_ufunc(op, sendbuf))
                and (res := self._shm_reduce(sendbuf, recvbuf if self.rank == root else None,
                                             op, ufunc, root))):
            return res  # (the engine's lean entry)
        recv: Buf | None = None
        if self.rank == root:
            if recvbuf is None:
                raise ValueError("Reduce: the root needs a receive buffer")
            recv = self._buf(recvbuf, True, "Reduce receive buffer")
            send = recv if sendbuf is IN_PLACE else self._buf(sendbuf, False,
                                                              "Reduce send buffer")
            self._same(send, recv, "Reduce", send.n)
        else:
            if sendbuf is IN_PLACE:
                raise ValueError("Reduce: IN_PLACE is allowed at the root only")
            send = self._buf(sendbuf, False, "Reduce send buffer")
        ufunc = _ufunc(op, send.arr)
        if not send.device and (res := self._shm_reduce(
                send.arr, None if recv is None else recv.arr, op, ufunc, root)):
            return res
        ch = self._chan("Reduce", send, fp=self._fp("Reduce", send, send.n, root, op))
        return self._run(ch, alg.reduce(ch, send, recv, root, ufunc))

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, root: int = 0) -> Request:
        """Non-blocking :meth:`Reduce`."""
        return self._request(self._traced(
            self._Reduce(sendbuf, recvbuf, op, root), "Reduce", root, posted=True))

    async def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, *,
                        timeout: float | None = None) -> None:
        """Element-wise reduction of every rank's ``sendbuf``, result in every rank's
        ``recvbuf`` (bit-identical everywhere). Recursive doubling for small messages,
        ring reduce-scatter + allgather (segmented) for large ones. Two ranks, small
        host arrays, SUM of 32/64-bit numbers: one call into compiled code (exchange and
        reduction; ``DONE`` is returned when it finished there); likewise up to 32
        ranks (every input to every rank, folded in rank order), and for small Bcast,
        Allgather, Alltoall and Reduce_scatter_block."""
        if timeout is not None:
            return await self._deadline(self._Allreduce, (sendbuf, recvbuf, op),
                                        timeout, "Allreduce")
        res = self._Allreduce(sendbuf, recvbuf, op)
        if res is not DONE:
            await self._traced(res, "Allreduce")

    def _Allreduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Awaitable[None]:
        """Start :meth:`Allreduce` (checks first): what to await, or DONE."""
        if self._entry is not None and (res := self._entry.allreduce(
                recvbuf if sendbuf is IN_PLACE else sendbuf, recvbuf, op)) is not None:
            return cast(Awaitable[None], res)
        fast = self._fast_ar
        if fast is not None:
            if fast is _UNMADE:
                made = self._make_fast()
                fast = None if made is None else made.allreduce
            if fast is not None:
                rest = fast(sendbuf, recvbuf, op)
                if rest is not None:
                    return rest if rest is DONE else self._small.allreduce_rest(rest, recvbuf)
        return self._allreduce(sendbuf, recvbuf, op)

    def _make_fast(self) -> Any:
        """The compiled small collectives (``comm/_fast.pyx``'s ``FastCollectives``),
        made on the first call that can use them (they need the peers' endpoints); None
        while the communicator is closed (the general paths raise)."""
        if self._group.closed or self._group.world.closed:
            return None
        from . import _fast

        pair = self._fast = _fast.FastCollectives(self._group)
        self._fast_ar = pair.allreduce
        return pair

    def _allreduce(self, sendbuf: Any, recvbuf: Any, op: Op) -> Awaitable[None]:
        """:meth:`Allreduce` where the compiled call does not serve it: the Python small
        path, recursive doubling below the ring threshold, else the ring."""
        if (self._shm is not None and small_ok(recvbuf) and recvbuf.nbytes > SMALL_MAX
                and recvbuf.flags.writeable
                and (sendbuf is IN_PLACE or (small_ok(sendbuf) and sendbuf.dtype == recvbuf.dtype
                                             and sendbuf.size == recvbuf.size))
                and (ufunc := _lean_ufunc(op, recvbuf))
                and (res := self._shm_allreduce(recvbuf if sendbuf is IN_PLACE else sendbuf,
                                                recvbuf, op, ufunc))):
            return res  # (the engine's lean entry)
        if self._group.check:
            return self._allreduce_checked(sendbuf, recvbuf, op)
        if (type(recvbuf) is np.ndarray and recvbuf.nbytes < alg.TUNING["allreduce_ring_min"]
                and self.size > 1 and isinstance(op, Op)):
            flags = recvbuf.flags
            if flags.c_contiguous and flags.writeable and (
                    sendbuf is IN_PLACE or (type(sendbuf) is np.ndarray
                                            and sendbuf.dtype == recvbuf.dtype
                                            and sendbuf.shape == recvbuf.shape
                                            and sendbuf.flags.c_contiguous)):
                key = (op, recvbuf.dtype)
                ufunc = _fast_ufuncs.get(key)
                if ufunc is None:
                    ufunc = _fast_ufuncs[key] = _ufunc(op, recvbuf)
                if self._small.usable(recvbuf.nbytes):
                    src = recvbuf if sendbuf is IN_PLACE else cast(np.ndarray, sendbuf)
                    return self._small.allreduce(self._small_chan("Allreduce"), src, recvbuf, ufunc)
                src = recvbuf if sendbuf is IN_PLACE else cast(np.ndarray, sendbuf)
                if res := self._shm_allreduce(src, recvbuf, op, ufunc):
                    return res
                self._check_open()
                ch = Chan(self._group, self._next_seq(), "Allreduce")
                return self._allreduce_small(ch, src, recvbuf, ufunc)
        recv = self._buf(recvbuf, True, "Allreduce receive buffer")
        send = recv if sendbuf is IN_PLACE else self._buf(sendbuf, False,
                                                          "Allreduce send buffer")
        self._same(send, recv, "Allreduce", send.n)
        ufunc = _ufunc(op, send.arr)
        if not recv.device and (res := self._shm_allreduce(send.arr, recv.arr, op, ufunc)):
            return res
        ch = self._chan("Allreduce", send)
        return self._run(ch, alg.allreduce(ch, send, recv, ufunc))

    def _allreduce_checked(self, sendbuf: Any, recvbuf: Any, op: Op) -> Awaitable[None]:
        """:meth:`_allreduce` with fingerprints: the combined form for small host
        arrays, else a fingerprint round, then recursive doubling or the ring."""
        recv = self._buf(recvbuf, True, "Allreduce receive buffer")
        send = recv if sendbuf is IN_PLACE else self._buf(sendbuf, False,
                                                          "Allreduce send buffer")
        self._same(send, recv, "Allreduce", send.n)
        ufunc = _ufunc(op, send.arr)
        if self.size > 1 and not recv.device and self._small.usable(recv.arr.nbytes):
            return self._combined("Allreduce", send.arr, recv.arr, -1, op, ufunc, recv.arr)
        if not recv.device and (res := self._shm_allreduce(send.arr, recv.arr, op, ufunc)):
            return res
        fp = self._fp("Allreduce", send, send.n, -1, op)
        if (not recv.device and self.size > 1
                and recv.arr.nbytes < alg.TUNING["allreduce_ring_min"]):
            self._check_open()
            ch = Chan(self._group, self._next_seq(), "Allreduce")
            ch.fp = fp
            return self._allreduce_small(ch, send.arr, recv.arr, ufunc)
        ch = self._chan("Allreduce", send, fp=fp)
        return self._run(ch, alg.allreduce(ch, send, recv, ufunc))

    async def _allreduce_small(self, ch: Chan, send: Any, recv: Any, ufunc: Any) -> None:
        """Host arrays below the ring threshold: recursive doubling, no Buf wrappers,
        scratch memory reused between calls on the same shape and dtype."""
        transport = self._transport
        cache = self._rd_scratch
        if cache is not None and cache[0] == recv.dtype and cache[1] == recv.shape:
            self._rd_scratch = None  # in use (a concurrent call allocates its own)
            tmp, tmp_target = cache[2], cache[3]
        else:
            tmp = np.empty_like(recv)
            tmp_target = transport.recv_ptr(tmp)
        recv_target = transport.recv_ptr(recv)
        send_target = recv_target if send is recv else transport.send_ptr(send)
        if ch.fp is not None:
            await self._check(ch)
        await ch.guard(alg.allreduce_recursive_doubling(ch, send, send_target, recv,
                                                        recv_target, tmp, tmp_target, ufunc))
        self._rd_scratch = (recv.dtype, recv.shape, tmp, tmp_target)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Request:
        """Non-blocking :meth:`Allreduce`."""
        return self._request(self._traced(
            self._allreduce(sendbuf, recvbuf, op), "Allreduce", posted=True))

    def _gatherv(self, sendbuf: Any, recvspec: Any, root: int, v: bool) -> Awaitable[None]:
        name = "Gatherv" if v else "Gather"
        root = self._group.check_peer(root, "root")
        p, r = self.size, self.rank
        if not v and self._shm is not None and small_ok(sendbuf):
            if r != root:  # (the engine's lean entry)
                if res := self._shm_start(name, sendbuf.nbytes, sendbuf, sendbuf,
                                          sendbuf.nbytes, root, count=sendbuf.size):
                    return res
            elif (small_ok(recvspec) and recvspec.flags.writeable
                  and sendbuf.dtype == recvspec.dtype and recvspec.size == sendbuf.size * p
                  and (res := self._shm_start(name, sendbuf.nbytes, sendbuf, recvspec,
                                              sendbuf.nbytes, root, count=sendbuf.size))):
                return res
        send: Buf | None = None
        recv: Buf | None = None
        if r != root:
            if sendbuf is IN_PLACE:
                raise ValueError(f"{name}: IN_PLACE is allowed at the root only")
            send = self._buf(sendbuf, False, f"{name} send buffer")
            counts = [send.n] * p  # only counts[r] matters off the root
            displs = counts
        else:
            if v:
                recv, counts, displs = self._spec(recvspec, True, f"{name} receive")
            else:
                if recvspec is None:
                    raise ValueError(f"{name}: the root needs a receive buffer")
                recv = self._buf(recvspec, True, f"{name} receive buffer")
                counts, displs = _equal_blocks(recv.n, p, f"{name} receive buffer")
            if sendbuf is not IN_PLACE:
                send = self._buf(sendbuf, False, f"{name} send buffer")
                self._same(send, recv, name)
                if send.n != counts[r]:
                    raise ValueError(f"{name}: the send buffer has {send.n} elements, the "
                                     f"root's block {counts[r]}")
        b = send if send is not None else recv
        assert b is not None
        if not v and not b.device:
            mine = send.arr if send is not None else b.arr[displs[r]:displs[r] + counts[r]]
            nbytes = counts[r] * b.itemsize
            if res := self._shm_start(name, nbytes, mine, mine if recv is None else recv.arr,
                                      nbytes, root, count=counts[r]):
                return res
        if v:
            fp = self._fp(name, b, -1, root, own=counts[r],
                          vec=counts if r == root else ())
        else:
            fp = self._fp(name, b, counts[r], root)
        ch = self._chan(name, send, recv, fp=fp)
        return self._run(ch, alg.gatherv(ch, send, recv, counts, displs, root))

    async def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0, *,
                     timeout: float | None = None) -> None:
        """Concatenate every rank's ``sendbuf`` into ``recvbuf`` at ``root`` (rank order)."""
        if timeout is not None:
            return await self._deadline(self._Gather, (sendbuf, recvbuf, root), timeout, "Gather")
        res = self._Gather(sendbuf, recvbuf, root)
        if res is not DONE:
            await self._traced(res, "Gather", root)

    def _Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Awaitable[None]:
        """Start :meth:`Gather` (checks first): what to await, or DONE."""
        if (self._entry is not None
                and (res := self._entry.gather(sendbuf, recvbuf, root)) is not None):
            return cast(Awaitable[None], res)
        return self._gatherv(sendbuf, recvbuf, root, False)

    async def Gatherv(self, sendbuf: Any, recvspec: Any, root: int = 0, *,
                      timeout: float | None = None) -> None:
        """:meth:`Gather` with per-rank counts: ``recvspec = (recvbuf, counts[, displs])``
        at the root (in elements)."""
        if timeout is not None:
            return await self._deadline(self._Gatherv, (sendbuf, recvspec, root),
                                        timeout, "Gatherv")
        res = self._Gatherv(sendbuf, recvspec, root)
        if res is not DONE:
            await self._traced(res, "Gatherv", root)

    def _Gatherv(self, sendbuf: Any, recvspec: Any, root: int = 0) -> Awaitable[None]:
        """Start :meth:`Gatherv` (checks first): what to await, or DONE."""
        return self._gatherv(sendbuf, recvspec, root, True)

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        return self._request(self._traced(
            self._gatherv(sendbuf, recvbuf, root, False), "Gather", root, posted=True))

    def Igatherv(self, sendbuf: Any, recvspec: Any, root: int = 0) -> Request:
        return self._request(self._traced(
            self._gatherv(sendbuf, recvspec, root, True), "Gatherv", root, posted=True))

    def _scatterv(self, sendspec: Any, recvbuf: Any, root: int, v: bool) -> Awaitable[None]:
        name = "Scatterv" if v else "Scatter"
        root = self._group.check_peer(root, "root")
        p, r = self.size, self.rank
        if not v and self._shm is not None and small_ok(recvbuf) and recvbuf.flags.writeable:
            if r != root:  # (the engine's lean entry)
                if res := self._shm_start(name, recvbuf.nbytes, recvbuf, recvbuf,
                                          recvbuf.nbytes, root, count=recvbuf.size):
                    return res
            elif (small_ok(sendspec) and sendspec.dtype == recvbuf.dtype
                  and sendspec.size == recvbuf.size * p
                  and (res := self._shm_start(name, recvbuf.nbytes, sendspec, recvbuf,
                                              recvbuf.nbytes, root, count=recvbuf.size))):
                return res
        send: Buf | None = None
        recv: Buf | None = None
        if r != root:
            if recvbuf is IN_PLACE:
                raise ValueError(f"{name}: IN_PLACE is allowed at the root only")
            recv = self._buf(recvbuf, True, f"{name} receive buffer")
            counts = [recv.n] * p
            displs = counts
        else:
            if v:
                send, counts, displs = self._spec(sendspec, False, f"{name} send")
            else:
                if sendspec is None:
                    raise ValueError(f"{name}: the root needs a send buffer")
                send = self._buf(sendspec, False, f"{name} send buffer")
                counts, displs = _equal_blocks(send.n, p, f"{name} send buffer")
            if recvbuf is not IN_PLACE:
                recv = self._buf(recvbuf, True, f"{name} receive buffer")
                self._same(send, recv, name)
                if recv.n < counts[r] or (not v and recv.n != counts[r]):
                    raise ValueError(f"{name}: the receive buffer has {recv.n} elements, "
                                     f"the root's block {counts[r]}")
        b = recv if recv is not None else send
        assert b is not None
        if not v and not b.device:
            src = send.arr if send is not None else b.arr
            mine = recv.arr if recv is not None else src[displs[r]:displs[r] + counts[r]]
            nbytes = counts[r] * b.itemsize
            if res := self._shm_start(name, nbytes, src, mine, nbytes, root, count=counts[r]):
                return res
        if v:
            fp = self._fp(name, b, -1, root, own=counts[r],  # (off the root: its buffer)
                          vec=counts if r == root else ())
        else:
            fp = self._fp(name, b, counts[r], root)
        ch = self._chan(name, send, recv, fp=fp)
        return self._run(ch, alg.scatterv(ch, send, counts, displs, recv, root))

    async def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *,
                      timeout: float | None = None) -> None:
        """Split ``sendbuf`` at ``root`` into ``size`` equal blocks; rank ``i`` gets
        block ``i`` in ``recvbuf`` (``recvbuf=IN_PLACE`` at the root)."""
        if timeout is not None:
            return await self._deadline(self._Scatter, (sendbuf, recvbuf, root), timeout, "Scatter")
        res = self._Scatter(sendbuf, recvbuf, root)
        if res is not DONE:
            await self._traced(res, "Scatter", root)

    def _Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Awaitable[None]:
        """Start :meth:`Scatter` (checks first): what to await, or DONE."""
        if (self._entry is not None
                and (res := self._entry.scatter(sendbuf, recvbuf, root)) is not None):
            return cast(Awaitable[None], res)
        return self._scatterv(sendbuf, recvbuf, root, False)

    async def Scatterv(self, sendspec: Any, recvbuf: Any, root: int = 0, *,
                       timeout: float | None = None) -> None:
        """:meth:`Scatter` with per-rank counts: ``sendspec = (sendbuf, counts[, displs])``."""
        if timeout is not None:
            return await self._deadline(self._Scatterv, (sendspec, recvbuf, root),
                                        timeout, "Scatterv")
        res = self._Scatterv(sendspec, recvbuf, root)
        if res is not DONE:
            await self._traced(res, "Scatterv", root)

    def _Scatterv(self, sendspec: Any, recvbuf: Any, root: int = 0) -> Awaitable[None]:
        """Start :meth:`Scatterv` (checks first): what to await, or DONE."""
        return self._scatterv(sendspec, recvbuf, root, True)

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        return self._request(self._traced(
            self._scatterv(sendbuf, recvbuf, root, False), "Scatter", root, posted=True))

    def Iscatterv(self, sendspec: Any, recvbuf: Any, root: int = 0) -> Request:
        return self._request(self._traced(
            self._scatterv(sendspec, recvbuf, root, True), "Scatterv", root, posted=True))

    def _allgatherv(self, sendbuf: Any, recvspec: Any, v: bool) -> Awaitable[None]:
        name = "Allgatherv" if v else "Allgather"
        p, r = self.size, self.rank
        if (not v and self._shm is not None and small_ok(sendbuf, recvspec)
                and sendbuf.nbytes > SMALL_MAX and recvspec.flags.writeable
                and sendbuf.dtype == recvspec.dtype
                and recvspec.size == sendbuf.size * p
                and (res := self._shm_start(name, sendbuf.nbytes, sendbuf, recvspec,
                                            sendbuf.nbytes, count=sendbuf.size))):
            return res  # (the engine's lean entry)
        if (not v and not self._group.check and small_ok(sendbuf, recvspec)
                and self._small.usable(sendbuf.nbytes) and recvspec.flags.writeable
                and sendbuf.dtype == recvspec.dtype and recvspec.size == sendbuf.size * p):
            return self._small.allgather(self._small_chan(name), sendbuf, recvspec)
        if v:
            recv, counts, displs = self._spec(recvspec, True, f"{name} receive")
        else:
            recv = self._buf(recvspec, True, f"{name} receive buffer")
            counts, displs = _equal_blocks(recv.n, p, f"{name} receive buffer")
        send: Buf | None = None
        if sendbuf is not IN_PLACE:
            send = self._buf(sendbuf, False, f"{name} send buffer")
            self._same(send, recv, name)
            if send.n != counts[r]:
                raise ValueError(f"{name}: the send buffer has {send.n} elements, "
                                 f"{counts[r]} expected (this rank's block)")
        if (not v and self._group.check and not recv.device
                and self._small.usable(counts[r] * recv.arr.itemsize)):
            own = recv.arr[displs[r]:displs[r] + counts[r]] if send is None else send.arr
            if send is None:
                own = own.copy()
            return self._combined(name, own, recv.arr)
        if not v and not recv.device and (res := self._shm_start(
                name, counts[r] * recv.itemsize,
                recv.arr[displs[r]:displs[r] + counts[r]] if send is None else send.arr,
                recv.arr, counts[r] * recv.itemsize, count=counts[r])):
            return res
        ch = self._chan(name, send, recv, fp=self._fp(
            name, recv, -1 if v else counts[r], own=counts[r], vec=counts if v else ()))

        if p == 1:
            async def run() -> None:
                if send is not None and counts[r]:
                    alg.copy(ch, recv.arr[displs[r]:displs[r] + counts[r]], send.arr)

            return self._run(ch, run())
        return self._run(ch, alg.allgatherv(ch, recv, counts, displs, send))

    async def Allgather(self, sendbuf: Any, recvbuf: Any, *, timeout: float | None = None) -> None:
        """Every rank's ``sendbuf`` concatenated in rank order into every ``recvbuf``
        (ring, segmented; ``sendbuf=IN_PLACE``: the block is already in place)."""
        if timeout is not None:
            return await self._deadline(self._Allgather, (sendbuf, recvbuf), timeout, "Allgather")
        res = self._Allgather(sendbuf, recvbuf)
        if res is not DONE:
            await self._traced(res, "Allgather")

    def _Allgather(self, sendbuf: Any, recvbuf: Any) -> Awaitable[None]:
        """Start :meth:`Allgather` (checks first): what to await, or DONE."""
        if (self._entry is not None
                and (res := self._entry.allgather(sendbuf, recvbuf)) is not None):
            return cast(Awaitable[None], res)
        pair = self._fast if self._fast is not _UNMADE else self._make_fast()
        if pair is not None:
            rest = pair.allgather(sendbuf, recvbuf)
            if rest is not None:
                return rest if rest is DONE else self._small.wait_rest(rest, "Allgather")
        return self._allgatherv(sendbuf, recvbuf, False)

    async def Allgatherv(self, sendbuf: Any, recvspec: Any, *,
                         timeout: float | None = None) -> None:
        """:meth:`Allgather` with per-rank counts: ``recvspec = (recvbuf, counts[, displs])``."""
        if timeout is not None:
            return await self._deadline(self._Allgatherv, (sendbuf, recvspec),
                                        timeout, "Allgatherv")
        res = self._Allgatherv(sendbuf, recvspec)
        if res is not DONE:
            await self._traced(res, "Allgatherv")

    def _Allgatherv(self, sendbuf: Any, recvspec: Any) -> Awaitable[None]:
        """Start :meth:`Allgatherv` (checks first): what to await, or DONE."""
        return self._allgatherv(sendbuf, recvspec, True)

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        return self._request(self._traced(
            self._allgatherv(sendbuf, recvbuf, False), "Allgather", posted=True))

    def Iallgatherv(self, sendbuf: Any, recvspec: Any) -> Request:
        return self._request(self._traced(
            self._allgatherv(sendbuf, recvspec, True), "Allgatherv", posted=True))

    def _alltoallv(self, sendspec: Any, recvspec: Any, v: bool) -> Awaitable[None]:
        name = "Alltoallv" if v else "Alltoall"
        p = self.size
        if (not v and self._shm is not None and small_ok(sendspec, recvspec)
                and recvspec.nbytes > SMALL_MAX * p and recvspec.flags.writeable
                and sendspec.dtype == recvspec.dtype
                and sendspec.size == recvspec.size and recvspec.size % p == 0
                and (res := self._shm_start(name, recvspec.nbytes // p, sendspec, recvspec,
                                            recvspec.nbytes // p, count=recvspec.size))):
            return res  # (the engine's lean entry: no Buf, no counts)
        if (not v and not self._group.check and small_ok(sendspec, recvspec)
                and recvspec.flags.writeable
                and sendspec.dtype == recvspec.dtype and sendspec.size == recvspec.size
                and sendspec.size % p == 0 and self._small.usable(sendspec.nbytes // p)):
            return self._small.alltoall(self._small_chan(name), sendspec, recvspec)
        if v:
            recv, rcounts, rdispls = self._spec(recvspec, True, f"{name} receive")
        else:
            recv = self._buf(recvspec, True, f"{name} receive buffer")
            rcounts, rdispls = _equal_blocks(recv.n, p, f"{name} receive buffer")
        in_place = sendspec is IN_PLACE
        if in_place:
            send, scounts, sdispls = recv, rcounts, rdispls
        elif v:
            send, scounts, sdispls = self._spec(sendspec, False, f"{name} send")
        else:
            send = self._buf(sendspec, False, f"{name} send buffer")
            if send.n != recv.n:
                raise ValueError(f"{name}: send ({send.n}) and receive ({recv.n}) element "
                                 "counts differ")
            scounts, sdispls = rcounts, rdispls
        self._same(send, recv, name)
        r = self.rank
        if scounts[r] != rcounts[r]:
            raise ValueError(f"{name}: this rank sends itself {scounts[r]} elements but "
                             f"expects {rcounts[r]}")
        if (not v and self._group.check and not recv.device and p > 1
                and self._small.usable(rcounts[0] * recv.arr.itemsize)):
            return self._combined(name, recv.arr.copy() if in_place else send.arr, recv.arr)
        if not v and not recv.device and (res := self._shm_start(
                name, rcounts[0] * recv.itemsize, recv.arr.copy() if in_place else send.arr,
                recv.arr, rcounts[0] * recv.itemsize, count=recv.n)):
            return res
        ch = self._chan(name, send, recv, fp=self._fp(
            name, recv, -1 if v else recv.n, vec=list(scounts) + list(rcounts) if v else ()))

        async def run() -> None:
            src = send
            if in_place:  # take the input out of the way first
                src = ch.scratch(recv, recv.n)
                alg.copy(ch, src.arr, recv.arr)
            await alg.alltoallv(ch, src, scounts, sdispls, recv, rcounts, rdispls)

        return self._run(ch, run())

    async def Alltoall(self, sendbuf: Any, recvbuf: Any, *, timeout: float | None = None) -> None:
        """Block ``j`` of rank ``i``'s ``sendbuf`` lands in block ``i`` of rank ``j``'s
        ``recvbuf`` (pairwise exchange)."""
        if timeout is not None:
            return await self._deadline(self._Alltoall, (sendbuf, recvbuf), timeout, "Alltoall")
        res = self._Alltoall(sendbuf, recvbuf)
        if res is not DONE:
            await self._traced(res, "Alltoall")

    def _Alltoall(self, sendbuf: Any, recvbuf: Any) -> Awaitable[None]:
        """Start :meth:`Alltoall` (checks first): what to await, or DONE."""
        if (self._entry is not None
                and (res := self._entry.alltoall(sendbuf, recvbuf)) is not None):
            return cast(Awaitable[None], res)
        pair = self._fast if self._fast is not _UNMADE else self._make_fast()
        if pair is not None:
            rest = pair.alltoall(sendbuf, recvbuf)
            if rest is not None:
                return rest if rest is DONE else self._small.wait_rest(rest, "Alltoall")
        return self._alltoallv(sendbuf, recvbuf, False)

    async def Alltoallv(self, sendspec: Any, recvspec: Any, *,
                        timeout: float | None = None) -> None:
        """:meth:`Alltoall` with ``(buf, counts[, displs])`` on both sides."""
        if timeout is not None:
            return await self._deadline(self._Alltoallv, (sendspec, recvspec), timeout, "Alltoallv")
        res = self._Alltoallv(sendspec, recvspec)
        if res is not DONE:
            await self._traced(res, "Alltoallv")

    def _Alltoallv(self, sendspec: Any, recvspec: Any) -> Awaitable[None]:
        """Start :meth:`Alltoallv` (checks first): what to await, or DONE."""
        return self._alltoallv(sendspec, recvspec, True)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        return self._request(self._traced(
            self._alltoallv(sendbuf, recvbuf, False), "Alltoall", posted=True))

    def Ialltoallv(self, sendspec: Any, recvspec: Any) -> Request:
        return self._request(self._traced(
            self._alltoallv(sendspec, recvspec, True), "Alltoallv", posted=True))

    def _reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any,
                        op: Op
                       ) -> Awaitable[None]:
        name = "Reduce_scatter_block" if recvcounts is None else "Reduce_scatter"
        p, r = self.size, self.rank
        if (recvcounts is None and not self._group.check and small_ok(sendbuf, recvbuf)
                and recvbuf.flags.writeable
                and sendbuf.dtype == recvbuf.dtype and sendbuf.size % p == 0
                and recvbuf.size >= sendbuf.size // p
                and self._small.usable(sendbuf.nbytes // p)):
            ufunc = _fast_ufuncs.get((op, sendbuf.dtype))
            if ufunc is None:  # (raises before the sequence number is taken)
                ufunc = _fast_ufuncs[(op, sendbuf.dtype)] = _ufunc(op, sendbuf)
            return self._small.reduce_scatter_block(self._small_chan(name), sendbuf, recvbuf,
                                                    ufunc)
        if (recvcounts is None and self._shm is not None and small_ok(sendbuf, recvbuf)
                and recvbuf.flags.writeable and sendbuf.dtype == recvbuf.dtype
                and recvbuf.size * p == sendbuf.size and (ufunc := _lean_ufunc(op, recvbuf))
                and (res := self._shm_start(name, recvbuf.nbytes, sendbuf, recvbuf,
                                            recvbuf.nbytes, op=op, ufunc=ufunc,
                                            count=sendbuf.size))):
            return res  # (the engine's lean entry)
        recv = self._buf(recvbuf, True, f"{name} receive buffer")
        in_place = sendbuf is IN_PLACE
        send = recv if in_place else self._buf(sendbuf, False, f"{name} send buffer")
        self._same(send, recv, name)
        if recvcounts is None:
            counts, displs = _equal_blocks(send.n, p, f"{name} input")
        else:
            counts = _counts(recvcounts, p, name)
            if sum(counts) != send.n:
                raise ValueError(f"{name}: the counts add up to {sum(counts)}, the "
                                 f"input has {send.n} elements")
            displs = _displs(None, counts, send.n, name)
        if not in_place and recv.n < counts[r]:
            raise ValueError(f"{name}: the receive buffer has {recv.n} elements, "
                             f"{counts[r]} needed")
        ufunc = _ufunc(op, send.arr)
        if (recvcounts is None and self._group.check and not recv.device and p > 1
                and self._small.usable(counts[0] * send.arr.itemsize)):
            return self._combined(name, send.arr.copy() if in_place else send.arr, recv.arr,
                                  -1, op, ufunc, recv.arr[:counts[r]])
        if recvcounts is None and not recv.device and (res := self._shm_start(
                name, counts[0] * send.itemsize, send.arr, recv.arr[:counts[r]],
                counts[0] * send.itemsize, op=op, ufunc=ufunc, count=send.n)):
            return res
        ch = self._chan(name, send, fp=self._fp(
            name, send, -1 if recvcounts is not None else send.n, -1, op,
            vec=counts if recvcounts is not None else ()))

        async def run() -> None:
            src = send
            if in_place:
                src = ch.scratch(recv, recv.n)
                alg.copy(ch, src.arr, recv.arr)
            if p == 1:
                if counts[0] and src is not recv:
                    alg.copy(ch, recv.arr[:counts[0]], src.arr[:counts[0]])
                return
            await alg.reduce_scatter(ch, src, recv, counts, displs, ufunc)

        return self._run(ch, run())

    async def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, *,
                                   timeout: float | None = None) -> None:
        """Reduce ``sendbuf`` (``size`` equal blocks) element-wise; rank ``i`` gets
        block ``i`` of the result (ring). ``sendbuf=IN_PLACE``: input from ``recvbuf``,
        result in its first block."""
        if timeout is not None:
            return await self._deadline(self._Reduce_scatter_block, (sendbuf, recvbuf, op),
                                        timeout, "Reduce_scatter_block")
        res = self._Reduce_scatter_block(sendbuf, recvbuf, op)
        if res is not DONE:
            await self._traced(res, "Reduce_scatter_block")

    def _Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Awaitable[None]:
        """Start :meth:`Reduce_scatter_block` (checks first): what to await, or DONE."""
        if (self._entry is not None and (res := self._entry.reduce_scatter_block(
                sendbuf, recvbuf, op)) is not None):
            return cast(Awaitable[None], res)
        pair = self._fast if self._fast is not _UNMADE else self._make_fast()
        if pair is not None:
            rest = pair.reduce_scatter_block(sendbuf, recvbuf, op)
            if rest is not None:
                return rest if rest is DONE else self._small.rsb_rest(rest, sendbuf,
                                                                           recvbuf)
        return self._reduce_scatter(sendbuf, recvbuf, None, op)

    async def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Sequence[int],
                             op: Op = SUM, *, timeout: float | None = None) -> None:
        """Like :meth:`Reduce_scatter_block` with ``recvcounts[i]`` elements for rank ``i``."""
        if timeout is not None:
            return await self._deadline(self._Reduce_scatter,
                                        (sendbuf, recvbuf, recvcounts, op), timeout,
                                        "Reduce_scatter")
        res = self._Reduce_scatter(sendbuf, recvbuf, recvcounts, op)
        if res is not DONE:
            await self._traced(res, "Reduce_scatter")

    def _Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Sequence[int],
                        op: Op = SUM) -> Awaitable[None]:
        """Start :meth:`Reduce_scatter` (checks first): what to await, or DONE."""
        if recvcounts is None:
            raise TypeError("Reduce_scatter: recvcounts is required")
        return self._reduce_scatter(sendbuf, recvbuf, recvcounts, op)

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Request:
        return self._request(self._traced(
            self._reduce_scatter(sendbuf, recvbuf, None, op), "Reduce_scatter_block", posted=True))

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Sequence[int],
                        op: Op = SUM) -> Request:
        if recvcounts is None:
            raise TypeError("Ireduce_scatter: recvcounts is required")
        return self._request(self._traced(
            self._reduce_scatter(sendbuf, recvbuf, recvcounts, op), "Reduce_scatter", posted=True))

    def _scan(self, sendbuf: Any, recvbuf: Any, op: Op, exclusive: bool) -> Awaitable[None]:
        name = "Exscan" if exclusive else "Scan"
        recv = self._buf(recvbuf, True, f"{name} receive buffer")
        send = recv if sendbuf is IN_PLACE else self._buf(sendbuf, False,
                                                          f"{name} send buffer")
        self._same(send, recv, name, send.n)
        ufunc = _ufunc(op, send.arr)
        ch = self._chan(name, send, fp=self._fp(name, send, send.n, -1, op))
        return self._run(ch, alg.scan(ch, send, recv, ufunc, exclusive))

    async def Scan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, *,
                   timeout: float | None = None) -> None:
        """Inclusive prefix reduction: rank ``i`` gets ``op`` over ranks ``0..i``."""
        if timeout is not None:
            return await self._deadline(self._Scan, (sendbuf, recvbuf, op), timeout, "Scan")
        res = self._Scan(sendbuf, recvbuf, op)
        if res is not DONE:
            await self._traced(res, "Scan")

    def _Scan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Awaitable[None]:
        """Start :meth:`Scan` (checks first): what to await, or DONE."""
        return self._scan(sendbuf, recvbuf, op, False)

    async def Exscan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, *,
                     timeout: float | None = None) -> None:
        """Exclusive prefix reduction over ranks ``0..i-1`` (rank 0's ``recvbuf`` is
        left as it was)."""
        if timeout is not None:
            return await self._deadline(self._Exscan, (sendbuf, recvbuf, op), timeout, "Exscan")
        res = self._Exscan(sendbuf, recvbuf, op)
        if res is not DONE:
            await self._traced(res, "Exscan")

    def _Exscan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Awaitable[None]:
        """Start :meth:`Exscan` (checks first): what to await, or DONE."""
        return self._scan(sendbuf, recvbuf, op, True)

    def Iscan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Request:
        return self._request(self._traced(
            self._scan(sendbuf, recvbuf, op, False), "Scan", posted=True))

    def Iexscan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Request:
        return self._request(self._traced(
            self._scan(sendbuf, recvbuf, op, True), "Exscan", posted=True))

    # ============================================================== barrier
    async def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank of the communicator has entered the barrier.

        Dissemination algorithm: ceil(log2(size)) rounds of zero-byte messages.

        Raises
        ------
        ClosedError, PeerFailure, CommTimeoutError
        """
        if timeout is not None:
            return await self._deadline(self.barrier, (), timeout, "barrier")
        self._check_open()
        await self._traced(self._barrier(), "barrier")

    async def _deadline(self, call: Callable[..., Any], args: tuple[Any, ...],
                        timeout: Any, what: str) -> Any:
        """Collective ``call(*args)`` within ``timeout`` seconds. When it runs out, the
        ranks' collectives are out of step for good (this rank gave up on one the
        others may still be in, or were never in): the communicator takes no further
        collective (``Group.out_of_step`` says why; every collective's sequence number
        is refused) while point-to-point goes on working. What the abandoned collective
        had posted is withdrawn (its buffers are not written afterwards).

        Raises
        ------
        CommTimeoutError
            ``timeout`` ran out.
        ValueError, TypeError
            A bad ``timeout`` (before any I/O).
        """
        try:
            async with limit(check_timeout(timeout, what), what):
                res = call(*args)
                if res is DONE:
                    return None
                if what[0].isupper():  # (a buffer collective's start: recorded here)
                    return await self._traced(res, what, args[-1] if trace.KIND[what]
                                              in trace.ROOTED else None)
                return await res
        except CommTimeoutError:
            pass
        g = self._group
        if g.out_of_step is None:
            g.out_of_step = (
                f"{what} timed out after {timeout:g} s on rank {self.rank}, so the ranks' "
                "collectives on this communicator are out of step: it takes no further "
                "collective (point-to-point still works; close it, or use another "
                "communicator)")
        raise CommTimeoutError(f"{what} did not complete within {timeout:g} s; this "
                               "communicator takes no further collective")

    def ibarrier(self) -> Request:
        """Non-blocking barrier."""
        self._check_open()
        return self._request(self._traced(self._barrier(), "barrier", posted=True))

    Ibarrier = ibarrier

    def _barrier(self) -> Awaitable[None]:
        # The sequence number is taken now, in call order (ibarrier runs it later).
        if self._group.check and 2 <= self.size <= SMALL_MAX_RANKS:
            # (fingerprints from every rank to every rank: that is a barrier; compiled)
            return self._combined("barrier", _EMPTY, _EMPTY)
        return self._run_barrier(self._next_seq())

    async def _run_barrier(self, seq: int) -> None:
        g = self._group
        if g.check:  # (the round of fingerprints is itself a barrier)
            ch = Chan(g, seq, "barrier")
            await ch.guard(ch.check(fingerprint.make("barrier")))
            return
        transport = self._transport
        rank, size = self.rank, self.size
        stag = make_tag(g.cid, KIND_COLL, rank, seq)
        dist = 1
        while dist < size:
            dest = (rank + dist) % size
            src = (rank - dist) % size
            sfut = g.endpoint(dest).isend(b"", stag)
            utag, mask, _ = g.match(KIND_COLL, src, seq)
            res = transport.recv_into(transport.recv_ptr(bytearray(0)), utag, mask,
                                      g.peers_all)  # any member's death fails it
            if not isinstance(res, tuple):
                await g.await_recv(res)
            if sfut is not None:
                await transport.complete(sfut)
            dist *= 2

    # ============================================================== objects
    # A rank whose part fails (its object does not pickle or unpickle, the op raises)
    # sends a _Failed marker where its data would go and carries on with the algorithm,
    # so that no peer waits for data that will never come; the marker travels on in
    # place of every result it spoils. At the end the failing rank raises its own
    # exception and every rank that saw the marker raises CollectiveError.
    async def _ochecked(self, what: str, seq: int, coro: Awaitable[Any], root: int = -1,
                        op: Any = None) -> Any:
        """Object collective ``what``'s algorithm ``coro`` after its round of
        fingerprints (checks on; :mod:`ucxcomm.comm.fingerprint`)."""
        if self._group.check:
            ch = Chan(self._group, seq, what)
            ch.fp = fingerprint.make(what, fingerprint.GENERAL, op, root)
            try:
                await self._check(ch)
            except BaseException:
                close = getattr(coro, "close", None)
                if close is not None:
                    close()
                raise
        return await coro

    def _osend(self, call: _ObjCall, obj: Any, dest: int, seq: int) -> list[Any]:
        post = self._group.post_send_obj
        try:
            futs = post(obj, dest, KIND_COLL, seq)
        except UcxCommError:
            raise
        except Exception as exc:  # (does not pickle: the peer gets the marker instead)
            futs = post(call.fail(self.rank, exc), dest, KIND_COLL, seq)
        return [f for f in futs if f is not None]

    async def _orecv(self, call: _ObjCall, source: int, seq: int) -> Any:
        # Fails if any member dies (see Chan.recv), not only ``source``.
        g = self._group
        res = g.post_recv_obj(source, KIND_COLL, seq, g.peers_all)
        try:
            obj = (await g.finish_recv_obj(res))[0]
        except UcxCommError:
            raise
        except Exception as exc:  # (does not unpickle here)
            return call.fail(self.rank, exc)
        if type(obj) is _Failed:
            call.saw(obj)
        return obj

    def _combine(self, call: _ObjCall, fn: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
        """``fn(a, b)``, or the marker that spoils it."""
        if type(a) is _Failed:
            return a
        if type(b) is _Failed:
            return b
        try:
            return fn(a, b)
        except Exception as exc:
            return call.fail(self.rank, exc)

    @staticmethod
    def _pyop(op: Any) -> Callable[[Any, Any], Any]:
        if isinstance(op, Op):
            return op.pyfunc
        if callable(op):
            return op
        raise TypeError(f"op must be a ucxcomm.Op or a callable f(a, b), got {op!r}")

    async def _bcast_obj(self, call: _ObjCall, obj: Any, root: int, seq: int) -> Any:
        p = self.size
        v = (self.rank - root) % p
        parent, children = binomial(v, p)
        if parent is not None:
            obj = await self._orecv(call, (parent + root) % p, seq)
        futs: list[Any] = []
        for c in children:
            futs.extend(self._osend(call, obj, (c + root) % p, seq))
        if futs:
            await asyncio.gather(*futs)
        return obj

    async def bcast(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """``root``'s object, on every rank (binomial tree)."""
        if timeout is not None:
            return await self._deadline(self.bcast, (obj, root), timeout, "bcast")
        self._check_open()
        root = self._group.check_peer(root, "root")
        call = _ObjCall("bcast")
        seq = self._next_seq()
        return call.result(await self._traced(self._ochecked(
            "bcast", seq, self._bcast_obj(call, obj, root, seq), root), "bcast", root))

    async def _reduce_obj(self, call: _ObjCall, obj: Any, fn: Callable[[Any, Any], Any],
                          root: int, seqs: tuple[int, int]) -> Any:
        # Binomial tree rooted at rank 0: each subtree is a contiguous rank range, so
        # combining children nearest-first keeps rank order (non-commutative ops work).
        r = self.rank
        parent, children = binomial(r, self.size)
        acc = obj
        for c in reversed(children):
            acc = self._combine(call, fn, acc, await self._orecv(call, c, seqs[0]))
        if parent is not None:
            await asyncio.gather(*self._osend(call, acc, parent, seqs[0]))
            acc = None
        if root != 0:
            if r == 0:
                await asyncio.gather(*self._osend(call, acc, root, seqs[1]))
                return None
            if r == root:
                return await self._orecv(call, 0, seqs[1])
        return acc

    async def reduce(self, obj: Any, op: Any = SUM, root: int = 0, *,
                     timeout: float | None = None) -> Any:
        """``op`` over every rank's object, in rank order, at ``root`` (None elsewhere).
        ``op`` is a :class:`~ucxcomm.Op` or any callable ``f(a, b)``. Where ``op``
        raises, that rank raises it and ``root`` raises :class:`~ucxcomm.CollectiveError`."""
        if timeout is not None:
            return await self._deadline(self.reduce, (obj, op, root), timeout, "reduce")
        self._check_open()
        root = self._group.check_peer(root, "root")
        fn = self._pyop(op)
        seq = self._next_seq()
        call = _ObjCall("reduce")
        return call.result(await self._traced(self._ochecked(
            "reduce", seq, self._reduce_obj(call, obj, fn, root, (seq, seq)), root, op),
            "reduce", root))

    async def allreduce(self, obj: Any, op: Any = SUM, *, timeout: float | None = None) -> Any:
        """``op`` over every rank's object in rank order; the same result everywhere.
        Where ``op`` raises (or an object does not pickle), that rank raises it and every
        other rank :class:`~ucxcomm.CollectiveError`."""
        if timeout is not None:
            return await self._deadline(self.allreduce, (obj, op), timeout, "allreduce")
        self._check_open()
        fn = self._pyop(op)
        seq = self._next_seq()
        call = _ObjCall("allreduce")
        return call.result(await self._traced(self._ochecked(
            "allreduce", seq, self._allreduce_obj(call, obj, fn, (seq, seq)), op=op),
            "allreduce"))

    async def _allreduce_obj(self, call: _ObjCall, obj: Any, fn: Callable[[Any, Any], Any],
                             seqs: tuple[int, int]) -> Any:
        acc = await self._reduce_obj(call, obj, fn, 0, seqs)
        return await self._bcast_obj(call, acc, 0, seqs[1])

    async def _gather_obj(self, call: _ObjCall, obj: Any, root: int,
                          seq: int) -> list[Any] | None:
        if self.rank != root:
            await asyncio.gather(*self._osend(call, obj, root, seq))
            return None
        out: list[Any] = [None] * self.size
        out[root] = obj
        for q in range(self.size):
            if q != root:
                out[q] = await self._orecv(call, q, seq)
        return out

    async def gather(self, obj: Any, root: int = 0, *,
                     timeout: float | None = None) -> list[Any] | None:
        """Every rank's object, as a list in rank order at ``root`` (None elsewhere)."""
        if timeout is not None:
            return await self._deadline(self.gather, (obj, root), timeout, "gather")
        self._check_open()
        root = self._group.check_peer(root, "root")
        call = _ObjCall("gather")
        seq = self._next_seq()
        return call.result(await self._traced(self._ochecked(
            "gather", seq, self._gather_obj(call, obj, root, seq), root), "gather", root))

    async def allgather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's object, as a list in rank order, on every rank. An object that
        does not pickle: its rank raises that error, every other rank
        :class:`~ucxcomm.CollectiveError`."""
        if timeout is not None:
            return await self._deadline(self.allgather, (obj,), timeout, "allgather")
        self._check_open()
        seq = self._next_seq()
        call = _ObjCall("allgather")
        return call.result(await self._traced(self._ochecked(
            "allgather", seq, self._allgather_obj(call, obj, (seq, seq))), "allgather"))

    async def _allgather_obj(self, call: _ObjCall, obj: Any, seqs: tuple[int, int]) -> Any:
        got: Any = await self._gather_obj(call, obj, 0, seqs[0])
        if self.rank == 0 and call.failed is not None:
            got = call.failed  # (the list is spoilt: the marker goes out instead)
        return await self._bcast_obj(call, got, 0, seqs[1])

    async def scatter(self, objs: Sequence[Any] | None, root: int = 0, *,
                      timeout: float | None = None) -> Any:
        """Rank ``i`` gets ``objs[i]`` from ``root`` (``objs`` is ignored elsewhere)."""
        if timeout is not None:
            return await self._deadline(self.scatter, (objs, root), timeout, "scatter")
        self._check_open()
        root = self._group.check_peer(root, "root")
        if self.rank == root:
            if objs is None or len(objs) != self.size:
                raise ValueError(f"scatter: the root needs a sequence of {self.size} "
                                 f"objects, got {None if objs is None else len(objs)}")
            items = list(objs)
        seq = self._next_seq()
        call = _ObjCall("scatter")
        if self.rank != root:
            return call.result(await self._traced(self._ochecked(
                "scatter", seq, self._orecv(call, root, seq), root), "scatter", root))
        return call.result(await self._traced(self._ochecked(
            "scatter", seq, self._scatter_obj(call, items, root, seq), root), "scatter", root))

    async def _scatter_obj(self, call: _ObjCall, items: list[Any], root: int, seq: int) -> Any:
        futs: list[Any] = []
        for q in range(self.size):
            if q != root:
                futs.extend(self._osend(call, items[q], q, seq))
        if futs:
            await asyncio.gather(*futs)
        return items[root]

    async def alltoall(self, objs: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
        """Rank ``i`` sends ``objs[j]`` to rank ``j``; returns what each rank sent here."""
        if timeout is not None:
            return await self._deadline(self.alltoall, (objs,), timeout, "alltoall")
        self._check_open()
        if objs is None or len(objs) != self.size:
            raise ValueError(f"alltoall: expected a sequence of {self.size} objects")
        items = list(objs)
        seq = self._next_seq()
        call = _ObjCall("alltoall")
        return call.result(await self._traced(self._ochecked(
            "alltoall", seq, self._alltoall_obj(call, items, seq)), "alltoall"))

    async def _alltoall_obj(self, call: _ObjCall, items: list[Any], seq: int) -> list[Any]:
        p, r = self.size, self.rank
        futs: list[Any] = []
        for s in range(1, p):
            futs.extend(self._osend(call, items[(r + s) % p], (r + s) % p, seq))
        out: list[Any] = [None] * p
        out[r] = items[r]
        for s in range(1, p):
            q = (r - s) % p
            out[q] = await self._orecv(call, q, seq)
        if futs:
            await asyncio.gather(*futs)
        return out

    async def _scan_obj(self, obj: Any, op: Any, exclusive: bool) -> Any:
        self._check_open()
        fn = self._pyop(op)
        seq = self._next_seq()
        call = _ObjCall("exscan" if exclusive else "scan")
        return call.result(await self._traced(self._ochecked(
            call.name, seq, self._scan_steps(call, obj, fn, exclusive, seq), op=op),
            call.name))

    async def _scan_steps(self, call: _ObjCall, obj: Any, fn: Callable[[Any, Any], Any],
                          exclusive: bool, seq: int) -> Any:
        r, p = self.rank, self.size
        partial, result, have = obj, (None if exclusive else obj), not exclusive
        mask = 1
        while mask < p:
            dst = r ^ mask
            if dst < p:
                futs = self._osend(call, partial, dst, seq)
                other = await self._orecv(call, dst, seq)
                if futs:
                    await asyncio.gather(*futs)
                if dst < r:
                    partial = self._combine(call, fn, other, partial)
                    result = self._combine(call, fn, other, result) if have else other
                    have = True
                else:
                    partial = self._combine(call, fn, partial, other)
            mask <<= 1
        if type(result) is not _Failed:
            call.failed = None  # (a failure this rank's result does not depend on)
        return result

    async def scan(self, obj: Any, op: Any = SUM, *, timeout: float | None = None) -> Any:
        """Inclusive prefix: rank ``i`` gets ``op`` over ranks ``0..i`` (in rank order)."""
        if timeout is not None:
            return await self._deadline(self.scan, (obj, op), timeout, "scan")
        return await self._scan_obj(obj, op, False)

    async def exscan(self, obj: Any, op: Any = SUM, *, timeout: float | None = None) -> Any:
        """Exclusive prefix over ranks ``0..i-1``; None on rank 0."""
        if timeout is not None:
            return await self._deadline(self.exscan, (obj, op), timeout, "exscan")
        return await self._scan_obj(obj, op, True)


class _Failed:
    """Sent in place of its data by a rank whose part of an object collective failed
    (and passed on in place of every result it spoils)."""

    __slots__ = ("cause", "rank")

    def __init__(self, rank: int, cause: str) -> None:
        self.rank, self.cause = rank, cause

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Failed, (self.rank, self.cause))


class _ObjCall:
    """One object collective on this rank: what failed here, or the marker seen."""

    __slots__ = ("error", "failed", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: BaseException | None = None  # this rank's own failure
        self.failed: _Failed | None = None  # the first marker made or seen

    def fail(self, rank: int, exc: BaseException) -> _Failed:
        """Record this rank's failure (the first one counts); the marker to send on."""
        if self.error is None:
            self.error = exc
            self.failed = _Failed(rank, f"{type(exc).__name__}: {exc}")
        assert self.failed is not None
        return self.failed

    def saw(self, marker: _Failed) -> None:
        if self.failed is None:
            self.failed = marker

    def result(self, value: Any) -> Any:
        """``value``, or what the call raises: this rank's own exception, else
        CollectiveError when ``value`` is (or holds) a marker."""
        if self.error is not None:
            raise self.error
        marker = value if type(value) is _Failed else None
        if marker is None and type(value) is list:
            marker = next((v for v in value if type(v) is _Failed), None)
        if marker is None:
            return value
        raise CollectiveError(f"{self.name} failed on rank {marker.rank}: {marker.cause}",
                              rank=marker.rank, cause=marker.cause)

"""``ProcessGroupUCXComm``: torch.distributed's ProcessGroup API on ucxcomm collectives.

torch calls arrive on torch's threads (the caller's, autograd's for DDP). Each call checks
its arguments there (errors at the call, before anything moves), then hands the
operation to the process's ucxcomm event-loop thread in call order, and returns a
:class:`~ucxcomm.torch._work.Work` at once. The loop thread starts the ucxcomm
collective (which takes its sequence number then, so every rank runs the operations in
the order torch issued them) and completes the Work when it ends.

Tensors: CPU tensors are handed to ucxcomm as numpy views (``tensor.numpy()``, zero
copy); CUDA tensors as themselves (``__cuda_array_interface__``), after the current
stream has finished producing them. Operations that only move data work on byte views,
so every dtype works (``bfloat16`` included); reductions use the tensor's dtype, except
``bfloat16``, which is reduced in ``float32`` and rounded once at the end.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import comm as _c
from .._deadline import Deadline, within
from ..comm import IN_PLACE, TAG_UB, Op
from ..errors import CommTimeoutError, PeerFailure, UnsupportedError
from ._bootstrap import form_world
from ._work import (
    PeerFailureError,
    ShrinkMismatchError,
    Work,
    WorkError,
    WorkTimeoutError,
    loop_thread,
    release_loop_thread,
    translate,
)

__all__ = ["BACKEND_NAME", "ProcessGroupUCXComm", "create_process_group"]

log = logging.getLogger(__name__)

BACKEND_NAME = "ucxcomm"

_R = dist.ReduceOp  # (its SUM, AVG... are RedOpType values, what opts.reduceOp.op is)
#: torch reduction -> ucxcomm op (AVG: a SUM divided by the group's size).
_OPS: dict[Any, Op] = {_R.SUM: _c.SUM, _R.PRODUCT: _c.PROD, _R.MIN: _c.MIN, _R.MAX: _c.MAX,
                       _R.BAND: _c.BAND, _R.BOR: _c.BOR, _R.BXOR: _c.BXOR, _R.AVG: _c.SUM}
_INTEGRAL = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
#: dtypes numpy reduces (bfloat16 is reduced through a float32 copy).
_REDUCIBLE = (*_INTEGRAL, torch.float16, torch.float32, torch.float64, torch.complex64,
              torch.complex128)
_GRACE_S = 30.0  # a plain Work.wait() waits the operation's timeout plus this
_AGREE_MIN_S = 10.0  # shrink: its closing agreement's least timeout
#: Largest operation (bytes of its tensors) that runs on the caller's thread when the
#: loop is idle (ProcessGroupUCXComm._inline); larger ones always go to the loop thread,
#: where they overlap the caller's computation (DDP's buckets: the backward pass).
INLINE_MAX = 64 << 10


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 2`` / ``ranks 1, 2``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _seconds(timeout: Any) -> float | None:
    """A timedelta as seconds; None when unset (torch's default is negative)."""
    if isinstance(timeout, timedelta):
        s = timeout.total_seconds()
        return s if s > 0 else None
    return None


def _tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ucxcomm {what}: expected a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"ucxcomm {what}: {t.layout} tensors are not supported "
                         "(dense tensors only)")
    if not t.is_contiguous():
        raise ValueError(f"ucxcomm {what}: the tensor is not contiguous; pass "
                         "tensor.contiguous()")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"ucxcomm {what}: tensors on {t.device.type} are not supported "
                         "(CPU and CUDA only)")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"ucxcomm {what}: resolve the tensor's conjugate/negative view "
                         "first (tensor.resolve_conj(), .resolve_neg())")
    return t


def _one(tensors: Sequence[Any], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"ucxcomm {what}: expected one tensor, got {len(tensors)}")
    return _tensor(tensors[0], what)


def _same_device(tensors: Sequence[torch.Tensor], what: str) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"ucxcomm {what}: tensors on several devices "
                         f"({sorted(map(str, devices))})")


def _bytes(t: torch.Tensor) -> Any:
    """A flat uint8 view of ``t``'s memory, in the form ucxcomm takes for its device."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def _elements(t: torch.Tensor) -> Any:
    """A flat view of ``t`` in its own dtype (numpy on the host)."""
    if t.device.type == "cpu":
        return (t.detach() if t.requires_grad else t).numpy().reshape(-1)
    return t.detach().reshape(-1)


def _op(reduce_op: Any, dtype: torch.dtype, what: str) -> tuple[Op, bool]:
    """The ucxcomm op for torch's ``reduce_op`` on ``dtype``, and whether it is AVG.

    Raises
    ------
    ValueError
        An op ucxcomm does not support (``PREMUL_SUM``), or one that makes no sense on
        ``dtype`` (bitwise on floats, MIN/MAX on complex, AVG on integers).
    """
    kind = getattr(reduce_op, "op", reduce_op)
    hit = _op_cache.get((kind, dtype))
    if hit is not None:
        return hit
    op = _OPS.get(kind)
    if op is None:
        raise ValueError(f"ucxcomm {what}: ReduceOp {getattr(kind, 'name', kind)} is not "
                         f"supported (supported: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)")
    if dtype not in _REDUCIBLE and dtype != torch.bfloat16:
        raise ValueError(f"ucxcomm {what}: cannot reduce {dtype} tensors")
    if op in (_c.BAND, _c.BOR, _c.BXOR) and dtype not in _INTEGRAL:
        raise ValueError(f"ucxcomm {what}: {kind.name} needs integer or bool tensors, "
                         f"got {dtype}")
    if op in (_c.MIN, _c.MAX) and dtype.is_complex:
        raise ValueError(f"ucxcomm {what}: {kind.name} is not defined on {dtype}")
    avg = kind == _R.AVG
    if avg and (dtype in _INTEGRAL):
        raise ValueError(f"ucxcomm {what}: AVG needs floating-point tensors, got {dtype}")
    _op_cache[(kind, dtype)] = op, avg
    return op, avg


_op_cache: dict[tuple[Any, torch.dtype], tuple[Op, bool]] = {}  # (what _op accepted)


class _Reducible:
    """A tensor as a reduction operand: a view in its own dtype, or (bfloat16) a float32
    copy whose result :meth:`store` rounds back."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.stage = t.detach().float() if t.dtype == torch.bfloat16 else None
        self.arr = _elements(self.stage if self.stage is not None else t)

    def store(self, divide: int = 1) -> None:
        if self.stage is not None:
            if divide != 1:
                self.stage.div_(divide)
            self.tensor.detach().copy_(self.stage.reshape(self.tensor.shape))
        elif divide != 1:
            self.tensor.detach().div_(divide)
        _sync(self.tensor)


def _need_cupy(what: str) -> None:
    """CUDA tensors are reduced with cupy kernels: without cupy, say so at the call."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise UnsupportedError(f"ucxcomm {what}: CUDA tensors need cupy (pip install "
                               "'ucxcomm[gpu]')") from None


def _sync(t: torch.Tensor) -> None:
    """Wait for what this (loop) thread queued on ``t``'s device: the Work completes
    with the tensor ready on every stream."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class _Resume:
    """Awaitable that goes on with an awaitable's iterator stepped elsewhere first
    (``first``: what its last step yielded), as ``await`` would have."""

    __slots__ = ("_first", "_it")

    def __init__(self, it: Any, first: Any) -> None:
        self._it, self._first = it, first

    def __await__(self) -> Any:
        it, y = self._it, self._first
        self._it = self._first = None
        while True:
            try:
                sent = yield y
            except BaseException as exc:  # (a cancellation thrown in)
                try:
                    y = it.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    y = it.send(sent)
                except StopIteration as stop:
                    return stop.value


def _then(*fns: Callable[[], None] | None) -> Callable[[], None] | None:
    todo = [f for f in fns if f is not None]
    if not todo:
        return None

    def run() -> None:
        for f in todo:
            f()
    return run


class ProcessGroupUCXComm(dist.ProcessGroup):
    """A torch.distributed process group whose operations run on ucxcomm.

    Created by ``torch.distributed.init_process_group("ucxcomm")`` (and ``new_group(...,
    backend="ucxcomm")``) once ``ucxcomm.torch`` is imported; not meant to be built
    directly.

    Parameters
    ----------
    store : torch.distributed.Store
        The group's store (from torch); the ranks exchange UCX addresses through it.
    rank, size : int
        This process's rank in the group, and the group's size.
    timeout : datetime.timedelta
        ``init_process_group(timeout=)``: the deadline of forming the group and of each
        operation (an operation that runs out fails with ``WorkTimeoutError`` and the
        group is unusable afterwards, as with gloo and NCCL).

    Raises
    ------
    ucxcomm.BootstrapError, torch.distributed.DistStoreError
        The group could not form (a rank missing, the liveness store unreachable).
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (the stub lacks it)
        self._rank, self._size = rank, size
        self._timeout = _seconds(timeout) or 1800.0
        self._lt = loop_thread()
        try:
            world = form_world(self._lt, store, rank, size, self._timeout)
        except BaseException:
            release_loop_thread(self._lt)  # (the last user: the thread ends)
            raise
        self._attach(world, world.comm)

    @classmethod
    def _successor(cls, parent: ProcessGroupUCXComm, comm: _c.Comm,
                   timeout: float) -> ProcessGroupUCXComm:
        """The group :meth:`shrink` returns: ``comm`` (the survivors' communicator, on
        ``parent``'s world, whose ownership passes to it) as a process group."""
        self = cls.__new__(cls)
        dist.ProcessGroup.__init__(self, comm.rank, comm.size)  # type: ignore[call-arg]
        self._rank, self._size = comm.rank, comm.size
        self._timeout = timeout
        self._lt = loop_thread()
        self._attach(parent._world, comm)
        return self

    def _attach(self, world: _c.World, comm: _c.Comm) -> None:
        self._world = world
        self._comm = comm
        # Our calls progress the worker themselves (_inline): incoming traffic between
        # them must not wake the loop thread (it would take the loop, and the GIL, from
        # the next call).
        world.worker.set_idle_watch(False)
        self._broken: BaseException | None = None
        self._closed = False
        #: Whether closing this group closes the world (False once shrink handed it on).
        self._owns_world = True
        self._shrunk = False  # (shrink_group replaced this group)
        self._shrink_failed: BaseException | None = None  # (timed out, store gone)
        self._collecting = threading.local()
        # Operations running on the loop: work -> (task, whether it needs every member).
        self._inflight: dict[Work, tuple[asyncio.Task, bool]] = {}
        world.failure_listeners.append(self._peer_died)
        self._lt.add_closer(self._close)
        dead = comm.failed()  # (a member that died before the listener was in place)
        if dead:
            r = min(dead)
            self._broken = PeerFailureError(f"rank {r} died or left the job without "
                                            "closing", peer=r)

    # ------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch names a group through its C++ backends, which a Python group has none of:
    # without these, destroy_process_group(subgroup) fails ("ProcessGroup name not set").
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return getattr(self, "_group_desc", "")

    def __repr__(self) -> str:
        return f"ProcessGroupUCXComm(rank={self._rank}, size={self._size})"

    # --------------------------------------------------------- machinery
    def _check_open(self, what: str, collective: bool = True) -> None:
        if self._shrunk:
            raise WorkError(f"ucxcomm {what}: this process group was replaced by "
                            "shrink_group; use the group it returned (the default group, "
                            "when the default group was shrunk)")
        if self._closed:
            raise WorkError(f"ucxcomm {what}: the process group was shut down")
        if self._broken is not None and collective:
            msg = f"ucxcomm {what}: the process group is unusable after an earlier " \
                  f"failure: {self._broken}"
            if isinstance(self._broken, PeerFailure):
                raise PeerFailureError(msg, peer=self._broken.peer) from self._broken
            raise WorkError(msg) from self._broken

    def _peer(self, rank: Any, what: str) -> int:
        if type(rank) is not int or not 0 <= rank < self._size:
            raise ValueError(f"ucxcomm {what}: rank {rank!r} is not in the group "
                             f"(0..{self._size - 1})")
        return rank

    def _submit(self, what: str, outputs: list[torch.Tensor],
                start: Callable[[], Awaitable[Any]], *, keep: Any = None,
                after: Callable[[], None] | None = None, opts: Any = None,
                source: bool = False, cuda: Sequence[torch.Tensor] = (),
                collective: bool = True, nbytes: int = -1) -> Work:
        """Run the operation ``start`` (it starts the ucxcomm operation and returns its
        awaitable) and return its Work: on this thread when the loop is idle and the
        operation small (``nbytes``, by default its tensors' sizes; see
        :meth:`_inline`), otherwise handed to the loop thread. ``collective``: it needs
        every member (a death fails it, see :meth:`_peer_died`)."""
        self._check_open(what, collective)
        plans = getattr(self._collecting, "plans", None)
        if plans is not None:  # (part of a coalesced call: see _several)
            plans.append((what, outputs, start, keep, after, cuda))
            return None  # type: ignore[return-value]
        device = None
        for t in cuda:
            if t.is_cuda:  # the loop thread reads what the current stream produces
                _need_cupy(what)
                device = t.device
                torch.cuda.current_stream(device).synchronize()
                break
        lt = self._lt
        if nbytes < 0:
            nbytes = sum(t.nbytes for t in outputs) + sum(t.nbytes for t in cuda)
        timeout = _seconds(getattr(opts, "timeout", None)) or self._timeout
        work = Work(what, outputs, timeout + _GRACE_S)
        work.keep, work.after = keep, after
        if nbytes <= INLINE_MAX and device is None and not self._inflight and lt.enter():
            try:
                self._inline(work, start, timeout, source, collective)
            finally:
                lt.leave()
        else:
            lt.call(self._begin, work, start, timeout, source, device, collective)
        return work

    def _inline(self, work: Work, start: Callable[[], Awaitable[Any]], timeout: float,
                source: bool, collective: bool) -> None:
        """:meth:`_begin` on this thread while it owns the idle loop (LoopThread.enter):
        the operation runs here and, when it needs no wait, the Work is complete when
        the call returns (no hand-over to the loop thread and back). What has to wait
        goes on as a task on the loop from where it stopped, and completes the Work."""
        if self._broken is not None and collective:
            work.finish(self._broken)
            return
        ready = self._lt.ready
        try:
            it = start().__await__()
            first = it.send(None)
            while first is None and not ready:  # (a bare yield: nothing else is due)
                first = it.send(None)
        except StopIteration as stop:
            work.finish(source=stop.value.source if source else -1)
            return
        except Exception as exc:
            exc = self._in_group(exc, work.what)
            if isinstance(exc, PeerFailure) and self._broken is None:
                self._broken = exc  # (as _drive does)
            work.finish(exc)
            return
        task = self._lt.loop.create_task(self._drive(work, _Resume(it, first), timeout,
                                                     source))
        self._inflight[work] = (task, collective)

    def _begin(self, work: Work, start: Callable[[], Awaitable[Any]], timeout: float,
               source: bool, device: torch.device | None, collective: bool) -> None:
        if self._broken is not None and collective:  # (a death between call and here)
            work.finish(self._broken)
            return
        try:
            if device is not None:  # (cupy allocates and reduces on the current device)
                torch.cuda.set_device(device)
            aw = start()
        except Exception as exc:
            work.finish(self._in_group(exc, work.what))
            return
        task = self._lt.loop.create_task(self._drive(work, aw, timeout, source))
        self._inflight[work] = (task, collective)

    def _in_group(self, exc: Exception, what: str) -> Exception:
        """``exc`` as this group's members see it: ucxcomm's failures name ranks of
        its world, which are this group's own until shrink_group renumbers them."""
        if not isinstance(exc, PeerFailure) or isinstance(exc, PeerFailureError) or \
                self._comm is self._world.comm or exc.peer is None:
            return exc
        members = self._comm.group.members
        if exc.peer not in members:  # (not a member of this group: no rank in it)
            return PeerFailureError(f"ucxcomm {what}: {exc} (not a member of this group, "
                                    "shrunk without it)", peer=None)
        rank = members.index(exc.peer)
        new = PeerFailureError(f"ucxcomm {what}: rank {rank} of this group (rank "
                               f"{exc.peer} before shrink_group renumbered it): {exc}",
                               peer=rank)
        new.__cause__ = exc
        return new

    def _peer_died(self, world_rank: int) -> None:
        """A member died (the liveness store said so; on the loop): every collective in
        flight fails now naming it, since none can complete without it, even on ranks
        whose algorithm waits on another member rather than on the dead one; the group
        takes no more collectives. Point-to-point operations with live ranks go on.
        (``world_rank``: its rank in the world, which a shrunk group's ranks are not.)"""
        from ..transport.worker import PEER_GRACE_S

        members = self._comm.group.members
        if world_rank not in members:
            return  # (gone before this group was shrunk to its survivors)
        rank = members.index(world_rank)
        exc = PeerFailureError(f"rank {rank} died or left the job without closing",
                               peer=rank)
        if self._broken is None:
            self._broken = exc

        def fail() -> None:
            for work, (task, collective) in list(self._inflight.items()):
                if collective and not work.is_completed():
                    work.finish(exc)
                    task.cancel()  # (withdraws its receives: the tensors stay untouched)

        # After the transport's grace period: what it sent before dying is still
        # delivered, so collectives it had completed its part of finish normally.
        self._lt.loop.call_later(PEER_GRACE_S * 1.5, fail)

    async def _drive(self, work: Work, aw: Awaitable[Any], timeout: float,
                     source: bool) -> None:
        try:
            result = await within(aw, timeout, work.what, message=(
                f"ucxcomm {work.what}: not complete within the timeout of {timeout:g} s "
                "(the group's, init_process_group(timeout=), or the call's); the group "
                "is unusable now"))
        except asyncio.CancelledError:
            work.finish(WorkError(f"ucxcomm {work.what}: cancelled (shutting down)"))
            self._inflight.pop(work, None)
            raise
        except Exception as exc:
            exc = self._in_group(exc, work.what)
            if isinstance(exc, CommTimeoutError):
                exc = WorkTimeoutError(str(exc))
            if isinstance(exc, (WorkTimeoutError, PeerFailure)) and self._broken is None:
                self._broken = exc  # (the collectives are out of step from here on)
            work.finish(exc)
        else:
            work.finish(source=result.source if source else -1)
        self._inflight.pop(work, None)

    def _flat(self, what: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensors' bytes concatenated (a copy)."""
        return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])

    # ============================================================ collectives
    def allreduce(self, tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Work:
        opts = dist.AllreduceOptions() if opts is None else opts
        if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor) and \
                tensors[0].layout == torch.sparse_coo:
            return self._sparse_allreduce(tensors[0], opts)
        t = _one(tensors, "allreduce")
        op, avg = _op(opts.reduceOp, t.dtype, "allreduce")
        comm = self._comm
        if not avg and t.dtype is not torch.bfloat16 and t.device.type == "cpu":
            arr = (t.detach() if t.requires_grad else t).numpy()  # (the common case)
            return self._submit("allreduce", [t], lambda: comm.Allreduce(IN_PLACE, arr, op),
                                keep=arr, opts=opts, nbytes=arr.nbytes)
        r = _Reducible(t)
        size = self._size
        return self._submit("allreduce", [t], lambda: comm.Allreduce(IN_PLACE, r.arr, op),
                            keep=r, after=(lambda: r.store(size if avg else 1))
                            if avg or r.stage is not None else None,
                            opts=opts, cuda=[t])

    def _sparse_allreduce(self, t: torch.Tensor, opts: Any) -> Work:
        """SUM of sparse COO tensors (as gloo offers): every rank's indices and values
        gathered, in rank order, then summed by ``coalesce()``; ``t`` takes the sum."""
        what = "allreduce"
        if getattr(opts.reduceOp, "op", opts.reduceOp) != _R.SUM:
            raise ValueError(f"ucxcomm {what}: sparse tensors support SUM only")
        if t.device.type != "cpu":
            raise ValueError(f"ucxcomm {what}: sparse tensors must be on the CPU")
        if t.dtype not in _REDUCIBLE or t.dtype == torch.bool:
            raise ValueError(f"ucxcomm {what}: cannot reduce sparse {t.dtype} tensors")
        mine = t.detach().coalesce()
        idx, vals = mine.indices().numpy(), mine.values().numpy()
        parts: list[Any] = []

        async def start() -> None:
            parts.extend(await self._comm.allgather((idx, vals)))

        def after() -> None:
            total = torch.sparse_coo_tensor(
                torch.cat([torch.from_numpy(i) for i, _ in parts], dim=1),
                torch.cat([torch.from_numpy(v) for _, v in parts]), t.shape).coalesce()
            with torch.no_grad():  # (into t itself: a detached alias of a sparse
                t.copy_(total)       # tensor takes new indices without t seeing them)
        return self._submit(what, [t], start, keep=(idx, vals), after=after, opts=opts,
                            nbytes=idx.nbytes + vals.nbytes)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        if not tensors:
            raise ValueError("ucxcomm allreduce_coalesced: no tensors")
        ts = [_tensor(t, "allreduce_coalesced") for t in tensors]
        _same_device(ts, "allreduce_coalesced")
        if len({t.dtype for t in ts}) != 1:
            raise ValueError("ucxcomm allreduce_coalesced: the tensors must share a dtype")
        op, avg = _op(opts.reduceOp, ts[0].dtype, "allreduce_coalesced")
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        r = _Reducible(flat)
        size = self._size

        def copy_back() -> None:
            r.store(size if avg else 1)
            offset = 0
            for t in ts:
                n = t.numel()
                t.detach().copy_(flat[offset:offset + n].view(t.shape))
                offset += n
            _sync(flat)

        return self._submit("allreduce_coalesced", ts,
                            lambda: self._comm.Allreduce(IN_PLACE, r.arr, op),
                            keep=r, after=copy_back, opts=opts, cuda=ts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        opts = dist.BroadcastOptions() if opts is None else opts
        t = _one(tensors, "broadcast")
        root = self._peer(opts.rootRank, "broadcast root")
        buf = _bytes(t)
        return self._submit("broadcast", [t], lambda: self._comm.Bcast(buf, root),
                            keep=buf, opts=opts, cuda=[t])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        opts = dist.ReduceOptions() if opts is None else opts
        t = _one(tensors, "reduce")
        root = self._peer(opts.rootRank, "reduce root")
        op, avg = _op(opts.reduceOp, t.dtype, "reduce")
        r = _Reducible(t)
        size = self._size
        if self._rank == root:
            def start() -> Awaitable[Any]:
                return self._comm.Reduce(IN_PLACE, r.arr, op, root)
            after = (lambda: r.store(size if avg else 1)) if avg or r.stage is not None \
                else None
        else:
            def start() -> Awaitable[Any]:
                return self._comm.Reduce(r.arr, None, op, root)
            after = None
        return self._submit("reduce", [t], start, keep=r, after=after, opts=opts, cuda=[t])

    def _gather_into(self, what: str, outputs: Sequence[torch.Tensor],
                     inp: torch.Tensor) -> tuple[Any, list[int], Callable[[], None]]:
        """A staging buffer for ``outputs`` (one per rank), byte counts, and the copy-out."""
        if len(outputs) != self._size:
            raise ValueError(f"ucxcomm {what}: expected {self._size} output tensors, got "
                             f"{len(outputs)}")
        outs = [_tensor(o, what) for o in outputs]
        for o in outs:
            if o.dtype != inp.dtype:
                raise TypeError(f"ucxcomm {what}: output dtype {o.dtype} differs from the "
                                f"input's {inp.dtype}")
        _same_device([inp, *outs], what)
        counts = [o.numel() * o.element_size() for o in outs]
        stage = torch.empty(sum(counts), dtype=torch.uint8, device=inp.device)

        def copy_out() -> None:
            offset = 0
            for o, n in zip(outs, counts, strict=True):
                o.detach().reshape(-1).view(torch.uint8).copy_(stage[offset:offset + n])
                offset += n
            _sync(stage)
        return stage, counts, copy_out

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Work:
        inp = _one(input_tensors, "allgather")
        if len(output_tensors) != 1:
            raise ValueError("ucxcomm allgather: expected one list of output tensors")
        stage, counts, copy_out = self._gather_into("allgather", output_tensors[0], inp)
        if counts[self._rank] != inp.numel() * inp.element_size():
            raise ValueError("ucxcomm allgather: this rank's output tensor and the input "
                             "differ in size")
        send, recv = _bytes(inp), _bytes(stage)
        return self._submit("allgather", list(output_tensors[0]),
                            lambda: self._comm.Allgatherv(send, (recv, counts)),
                            keep=(send, recv, stage), after=copy_out, opts=opts,
                            cuda=[inp])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Work:
        out, inp = _tensor(output, "all_gather_into_tensor"), _tensor(input,
                                                                      "all_gather_into_tensor")
        if out.dtype != inp.dtype:
            raise TypeError(f"ucxcomm all_gather_into_tensor: dtypes differ ({out.dtype} "
                            f"vs {inp.dtype})")
        if out.numel() != inp.numel() * self._size:
            raise ValueError(f"ucxcomm all_gather_into_tensor: the output has {out.numel()} "
                             f"elements, {inp.numel() * self._size} expected")
        _same_device([out, inp], "all_gather_into_tensor")
        send, recv = _bytes(inp), _bytes(out)
        return self._submit("all_gather_into_tensor", [out],
                            lambda: self._comm.Allgather(send, recv), keep=(send, recv),
                            opts=opts, cuda=[inp])

    _allgather_base = all_gather_single

    def _several(self, what: str, calls: Callable[[], None], opts: Any) -> Work:
        """One Work for the operations that ``calls`` issues (on this thread): they are
        collected instead of submitted, then started together, in order."""
        plans: list[tuple[Any, ...]] = []
        self._collecting.plans = plans
        try:
            calls()
        finally:
            self._collecting.plans = None
        outputs = [t for p in plans for t in p[1]]
        afters = [p[4] for p in plans if p[4] is not None]

        def start() -> Awaitable[Any]:
            return asyncio.gather(*[p[2]() for p in plans])  # (started in order)

        def after() -> None:
            for fn in afters:
                fn()
        return self._submit(what, outputs, start, keep=[p[3] for p in plans],
                            after=after if afters else None, opts=opts,
                            cuda=[t for p in plans for t in p[5]])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> Work:
        """``output_lists[r][i]`` receives rank ``r``'s ``input_list[i]`` (torch's
        layout: one list per rank, one tensor per input); one all_gather per input."""
        what = "all_gather_coalesced"
        if len(output_lists) != self._size:
            raise ValueError(f"ucxcomm {what}: expected {self._size} output lists (one "
                             f"per rank), got {len(output_lists)}")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise ValueError(f"ucxcomm {what}: output list {r} has {len(outs)} "
                                 f"tensors; expected one tensor per input "
                                 f"({len(input_list)})")

        def calls() -> None:
            for i, inp in enumerate(input_list):
                self.allgather([[outs[i] for outs in output_lists]], [inp], opts)
        return self._several(what, calls, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        if len(outputs) != len(inputs):
            raise ValueError("ucxcomm allgather_into_tensor_coalesced: one output per input")

        def calls() -> None:
            for o, i in zip(outputs, inputs, strict=True):
                self.all_gather_single(o, i, opts)
        return self._several("allgather_into_tensor_coalesced", calls, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = dist.GatherOptions() if opts is None else opts
        inp = _one(input_tensors, "gather")
        root = self._peer(opts.rootRank, "gather root")
        send = _bytes(inp)
        if self._rank != root:
            return self._submit("gather", [], lambda: self._comm.Gatherv(send, None, root),
                                keep=send, opts=opts, cuda=[inp])
        if len(output_tensors) != 1:
            raise ValueError("ucxcomm gather: the root needs one list of output tensors")
        stage, counts, copy_out = self._gather_into("gather", output_tensors[0], inp)
        if counts[root] != len(send):
            raise ValueError("ucxcomm gather: the root's output tensor and its input differ "
                             "in size")
        recv = _bytes(stage)
        return self._submit("gather", list(output_tensors[0]),
                            lambda: self._comm.Gatherv(send, (recv, counts), root),
                            keep=(send, recv, stage), after=copy_out, opts=opts, cuda=[inp])

    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:
        opts = dist.ScatterOptions() if opts is None else opts
        out = _one(output_tensors, "scatter")
        root = self._peer(opts.rootRank, "scatter root")
        recv = _bytes(out)
        if self._rank != root:
            return self._submit("scatter", [out],
                                lambda: self._comm.Scatterv(None, recv, root),
                                keep=recv, opts=opts, cuda=[out])
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            raise ValueError(f"ucxcomm scatter: the root needs one list of {self._size} "
                             "input tensors")
        ins = [_tensor(t, "scatter") for t in input_tensors[0]]
        for t in ins:
            if t.dtype != out.dtype:
                raise TypeError(f"ucxcomm scatter: input dtype {t.dtype} differs from the "
                                f"output's {out.dtype}")
        _same_device([out, *ins], "scatter")
        counts = [t.numel() * t.element_size() for t in ins]
        if counts[root] != len(recv):
            raise ValueError("ucxcomm scatter: the root's input and output tensors differ "
                             "in size")
        stage = self._flat("scatter", ins)
        send = _bytes(stage)
        return self._submit("scatter", [out],
                            lambda: self._comm.Scatterv((send, counts), recv, root),
                            keep=(send, recv, stage), opts=opts, cuda=ins)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        out = _one(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            raise ValueError(f"ucxcomm reduce_scatter: expected one list of {self._size} "
                             "input tensors")
        ins = [_tensor(t, "reduce_scatter") for t in input_tensors[0]]
        for t in ins:
            if t.dtype != out.dtype:
                raise TypeError(f"ucxcomm reduce_scatter: input dtype {t.dtype} differs "
                                f"from the output's {out.dtype}")
        _same_device([out, *ins], "reduce_scatter")
        if ins[self._rank].numel() != out.numel():
            raise ValueError("ucxcomm reduce_scatter: this rank's input block and the "
                             "output differ in size")
        op, avg = _op(opts.reduceOp, out.dtype, "reduce_scatter")
        counts = [t.numel() for t in ins]
        src = _Reducible(torch.cat([t.detach().reshape(-1) for t in ins]))
        dst = _Reducible(out)
        size = self._size
        return self._submit(
            "reduce_scatter", [out],
            lambda: self._comm.Reduce_scatter(src.arr, dst.arr, counts, op),
            keep=(src, dst), opts=opts, cuda=ins,
            after=(lambda: dst.store(size if avg else 1)) if avg or dst.stage is not None
            else None)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Work:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        what = "reduce_scatter_tensor"
        out, inp = _tensor(output, what), _tensor(input, what)
        if out.dtype != inp.dtype:
            raise TypeError(f"ucxcomm {what}: dtypes differ ({out.dtype} vs {inp.dtype})")
        if inp.numel() != out.numel() * self._size:
            raise ValueError(f"ucxcomm {what}: the input has {inp.numel()} elements, "
                             f"{out.numel() * self._size} expected")
        _same_device([out, inp], what)
        op, avg = _op(opts.reduceOp, out.dtype, what)
        src, dst = _Reducible(inp), _Reducible(out)
        size = self._size
        return self._submit(
            what, [out], lambda: self._comm.Reduce_scatter_block(src.arr, dst.arr, op),
            keep=(src, dst), opts=opts, cuda=[inp],
            after=(lambda: dst.store(size if avg else 1)) if avg or dst.stage is not None
            else None)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        if len(outputs) != len(inputs):
            raise ValueError("ucxcomm reduce_scatter_tensor_coalesced: one output per input")

        def calls() -> None:
            for o, i in zip(outputs, inputs, strict=True):
                self.reduce_scatter_single(o, i, opts)
        return self._several("reduce_scatter_tensor_coalesced", calls, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Work:
        what = "all_to_all"
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise ValueError(f"ucxcomm {what}: expected {self._size} input and output "
                             "tensors")
        outs = [_tensor(t, what) for t in output_tensors]
        ins = [_tensor(t, what) for t in input_tensors]
        if len({t.dtype for t in outs + ins}) != 1:
            raise TypeError(f"ucxcomm {what}: the tensors must share a dtype")
        _same_device(outs + ins, what)
        scounts = [t.numel() * t.element_size() for t in ins]
        stage_in = self._flat(what, ins)
        stage_out, rcounts, copy_out = self._gather_into(what, outs, ins[0])
        send, recv = _bytes(stage_in), _bytes(stage_out)
        return self._submit(what, outs,
                            lambda: self._comm.Alltoallv((send, scounts), (recv, rcounts)),
                            keep=(send, recv, stage_in, stage_out), after=copy_out,
                            opts=opts, cuda=ins)

    def _splits(self, t: torch.Tensor, splits: Sequence[int] | None, what: str) -> list[int]:
        """Byte counts per rank from split sizes along dimension 0 (none: equal)."""
        rows = t.shape[0] if t.dim() > 0 else 1
        row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
        if not splits:
            if rows % self._size:
                raise ValueError(f"ucxcomm {what}: dimension 0 ({rows}) does not divide "
                                 f"into {self._size} equal parts; pass split sizes")
            return [rows // self._size * row_bytes] * self._size
        splits = list(splits)
        if len(splits) != self._size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"ucxcomm {what}: split sizes {splits} do not split dimension "
                             f"0 ({rows}) over {self._size} ranks")
        return [s * row_bytes for s in splits]

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None,
                          opts: Any = None) -> Work:
        what = "all_to_all_single"
        out, inp = _tensor(output, what), _tensor(input, what)
        if out.dtype != inp.dtype:
            raise TypeError(f"ucxcomm {what}: dtypes differ ({out.dtype} vs {inp.dtype})")
        _same_device([out, inp], what)
        scounts = self._splits(inp, input_split_sizes, what)
        rcounts = self._splits(out, output_split_sizes, what)
        send, recv = _bytes(inp), _bytes(out)
        return self._submit(what, [out],
                            lambda: self._comm.Alltoallv((send, scounts), (recv, rcounts)),
                            keep=(send, recv), opts=opts, cuda=[inp])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> Work:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      opts)

    def barrier(self, opts: Any = None) -> Work:
        return self._submit("barrier", [], lambda: self._comm.barrier(), opts=opts)

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """A barrier that, when it runs out of time, names the ranks that did not reach
        it (rank 0 collects every rank's arrival, then releases them all).

        Raises
        ------
        WorkTimeoutError
            Not every rank arrived within ``timeout`` (the group's by default); on rank
            0 the message names the ranks missing.
        """
        limit = _seconds(timeout) or self._timeout
        self._check_open("monitored_barrier")
        self._lt.run(self._monitored(limit, wait_all_ranks), limit + _GRACE_S)

    async def _monitored(self, limit: float, wait_all: bool) -> None:
        import numpy as np

        comm, tag = self._comm, TAG_UB  # the top user tag: torch's tags are small
        one = np.zeros(1, np.uint8)
        deadline = Deadline(limit, "monitored_barrier")
        if self._rank != 0:
            async def arrive_and_wait() -> None:
                await comm.Send(one, 0, tag)
                await comm.Recv(np.zeros(1, np.uint8), 0, tag)

            try:
                await deadline.wait(arrive_and_wait())
            except CommTimeoutError:
                err = WorkTimeoutError(f"ucxcomm monitored_barrier: rank 0 did not release "
                                       f"rank {self._rank} within {limit:g} s")
                self._broken = err
                raise err from None
            return
        reqs = {r: comm.Irecv(np.zeros(1, np.uint8), r, tag) for r in range(1, self._size)}
        missing = []
        for r, req in reqs.items():
            try:
                await deadline.wait(req)
            except (CommTimeoutError, PeerFailure):
                missing.append(r)
                req.cancel()
                if not wait_all:
                    break
        if missing:
            # Withdraw every receive still posted (left posted, a later barrier's arrivals
            # went to them), and the group is broken: a rank that timed out may still
            # find an old release (review finding).
            for req in reqs.values():
                if not req.done():
                    req.cancel()
            err = WorkTimeoutError(
                f"ucxcomm monitored_barrier: rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} did not reach the barrier within "
                f"{limit:g} s")
            self._broken = err
            raise err
        await asyncio.gather(*(comm.Send(one, r, tag) for r in range(1, self._size)))

    # ====================================================== point-to-point
    def _tag(self, tag: Any, what: str) -> int:
        if type(tag) is not int or not 0 <= tag < TAG_UB:
            raise ValueError(f"ucxcomm {what}: tag {tag!r} is out of range (0..{TAG_UB - 1})")
        return tag

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        t = _one(tensors, "send")
        dst, tag = self._peer(dst, "send destination"), self._tag(tag, "send")
        buf = _bytes(t)
        return self._submit("send", [t], lambda: self._comm.Isend(buf, dst, tag), keep=buf,
                            cuda=[t], collective=False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        t = _one(tensors, "recv")
        src, tag = self._peer(src, "recv source"), self._tag(tag, "recv")
        buf = _bytes(t)
        return self._submit("recv", [t], lambda: self._comm.Irecv(buf, src, tag), keep=buf,
                            cuda=[t], collective=False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        t = _one(tensors, "recv_anysource")
        tag = self._tag(tag, "recv_anysource")
        buf = _bytes(t)
        return self._submit("recv_anysource", [t],
                            lambda: self._comm.Irecv(buf, _c.ANY_SOURCE, tag), keep=buf,
                            source=True, cuda=[t])

    # ============================================================ shrinking
    #: torch.distributed.shrink_group asks the group's backend (here: the group itself).
    supports_shrinking = True

    def shrink(self, ranks_to_exclude: Sequence[int], shrink_flags: int = 0,
               opts_override: Any = None) -> ProcessGroupUCXComm:
        """The group of the survivors: ``torch.distributed.shrink_group(ranks_to_exclude,
        group, shrink_flags, pg_options)`` calls it on every rank not excluded, and
        makes what it returns the group (the default one, when it shrank that).

        The survivors agree on who is gone (ucxcomm's ``Comm.shrink``: the members alive
        when it is decided, old-rank order, the same endpoints), then check together
        that ``ranks_to_exclude`` are exactly those ranks, on every survivor: a rank
        excluded by torch is gone from the group, and a rank kept is alive in it. An
        excluded rank that is still alive must leave (exit, or
        ``destroy_process_group()``) for the decision to be taken. This group is
        replaced: its operations still in flight fail; the new one takes no
        collective that was issued on this one. See docs/torch.md, "Surviving a death".

        Parameters
        ----------
        ranks_to_exclude : sequence of int
            Ranks of this group that are gone (dead, or leaving).
        shrink_flags : int
            ``dist.SHRINK_DEFAULT`` (0), or ``dist.SHRINK_ABORT`` (1): revoke this group
            first, so that every member's pending operations on it fail at once
            (``ucxcomm.Revoked``, as a ``WorkError``), the excluded ranks' included.
        opts_override : object, optional
            torch's ``pg_options``: None (the new group keeps this one's timeout), or
            options with a ``_timeout`` (a ``timedelta``; e.g.
            ``torch._C._distributed_c10d.Backend.Options("ucxcomm", timeout)``), which
            bounds the shrink and becomes the new group's timeout.

        Returns
        -------
        ProcessGroupUCXComm
            The survivors' group, ranks in their old order.

        Raises
        ------
        ShrinkMismatchError
            The survivors agreed that other ranks are gone than ``ranks_to_exclude``
            (on this rank or another), or a survivor died during the shrink; raised on
            every survivor, no group made (``exc.gone``: the ranks to exclude).
        WorkTimeoutError
            The survivors could not decide within the timeout: an excluded rank
            still alive did not leave, or a survivor did not call shrink_group. The
            group is unusable afterwards.
        PeerFailureError
            The group's liveness store, which the decision needs, is gone (its rank
            0 died).
        UnsupportedError
            ``ranks_to_exclude`` has rank 0, which serves the group's liveness store.
        ValueError, TypeError
            Bad arguments, raised before anything moves.
        """
        what = "shrink_group"
        if self._closed or self._shrunk:
            raise WorkError(f"ucxcomm {what}: the process group was "
                            f"{'shrunk already' if self._shrunk else 'shut down'}")
        excluded = self._excluded(ranks_to_exclude, what)
        if shrink_flags not in (0, 1) or type(shrink_flags) is not int:
            raise ValueError(f"ucxcomm {what}: shrink_flags {shrink_flags!r} is neither "
                             "SHRINK_DEFAULT (0) nor SHRINK_ABORT (1)")
        timeout = self._timeout
        if opts_override is not None:
            limit = getattr(opts_override, "_timeout", None)
            if not isinstance(limit, timedelta):
                raise TypeError(f"ucxcomm {what}: pg_options must be None or options with "
                                f"a timedelta _timeout, got {type(opts_override).__name__}")
            timeout = _seconds(limit) or timeout
        if 0 in excluded:
            raise UnsupportedError(
                f"ucxcomm {what}: rank 0 cannot be excluded: it serves the group's liveness "
                "store (and, under torchrun or ucxcomm run, torch's own store), which the "
                "survivors need to agree; its death ends the group")
        if self._shrink_failed is not None:
            raise WorkError(f"ucxcomm {what}: the group is unusable after an earlier "
                            f"shrink_group failed: {self._shrink_failed}"
                            ) from self._shrink_failed
        try:
            comm = self._lt.run(self._shrink_comm(excluded, timeout, bool(shrink_flags)),
                                timeout + _AGREE_MIN_S + _GRACE_S)
        except ShrinkMismatchError:
            raise
        except (CommTimeoutError, TimeoutError) as exc:
            alive = sorted(set(excluded) - self._comm.failed())
            err = WorkTimeoutError(
                f"ucxcomm {what}: no decision within {timeout:g} s: "
                + (f"excluded {_ranks(alive)} {'are' if len(alive) > 1 else 'is'} still "
                   "alive (an excluded rank must exit or call destroy_process_group()), "
                   "or " if alive else "")
                + "a survivor did not call shrink_group; the group is unusable now")
            self._fail_shrink(err)
            raise err from exc
        except Exception as exc:
            failure = translate(exc, what)  # (the store gone: PeerFailureError)
            if isinstance(failure, WorkError):
                self._fail_shrink(failure)
            raise failure from exc
        successor = ProcessGroupUCXComm._successor(self, comm, timeout)
        self._hand_over()
        return successor

    def _excluded(self, ranks: Any, what: str) -> list[int]:
        """``ranks_to_exclude`` checked (torch checks them too, before calling us)."""
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"ucxcomm {what}: ranks_to_exclude must be a list of ranks, "
                            f"got {type(ranks).__name__}")
        excluded = sorted({self._peer(r, what) for r in ranks})
        if len(excluded) != len(ranks) or not excluded:
            raise ValueError(f"ucxcomm {what}: ranks_to_exclude {list(ranks)} must name "
                             "each rank once, at least one")
        if self._rank in excluded:
            raise ValueError(f"ucxcomm {what}: this rank ({self._rank}) is excluded; an "
                             "excluded rank does not call shrink_group")
        return excluded

    async def _shrink_comm(self, excluded: list[int], timeout: float,
                           abort: bool) -> _c.Comm:
        """On the loop: the survivors' communicator, once they agreed that each of them
        excluded exactly the ranks gone."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        old = self._comm
        if abort:
            old.revoke()
        new = await old.shrink(timeout=timeout)
        members = old.group.members
        kept = new.group.members
        gone = [r for r, m in enumerate(members) if m not in kept]
        try:
            # (at least a while of its own: a shrink that took the whole timeout
            # would otherwise time out here on some survivors only)
            ok, failed = await new.agree(gone == excluded, timeout=max(
                end - loop.time(), min(timeout, _AGREE_MIN_S)))
        except BaseException:
            new.abort()
            raise
        if ok and not failed:
            return new
        new.abort()  # (local: every survivor drops it alike)
        later = sorted(members.index(kept[r]) for r in failed)
        everyone = sorted(gone + later)
        why = (f"{_ranks(later)} died during it" if later else
               f"not every survivor excluded exactly those (this rank excluded {excluded})")
        if not everyone:  # (every member took part: an excluded one too)
            raise ShrinkMismatchError(
                "ucxcomm shrink_group: every member of the group took part, so none is "
                f"gone, yet this rank excluded {excluded}; no group was made", [])
        raise ShrinkMismatchError(
            f"ucxcomm shrink_group: the survivors agree that {_ranks(everyone)} "
            f"{'are' if len(everyone) > 1 else 'is'} gone, and {why}; no group was made: "
            f"call shrink_group({everyone}) on every survivor (exc.gone)", everyone)

    def _fail_shrink(self, err: BaseException) -> None:
        self._broken = self._shrink_failed = err

    def _hand_over(self) -> None:
        """After a shrink: the successor owns the world and hears of deaths; this group
        takes no more operations (torch destroys it next)."""
        self._shrunk = True
        self._owns_world = False
        try:
            self._world.failure_listeners.remove(self._peer_died)
        except ValueError:  # pragma: no cover - (removed once)
            pass
        self._lt.call(self._fail_inflight, "the group was shrunk (shrink_group)")
        if self._comm is not self._world.comm:
            # (a shrunk group shrunk again: its communicator goes; the world's stays
            # open, as the world does)
            self._lt.call(self._comm.abort)

    def _fail_inflight(self, why: str) -> None:
        """(On the loop.) Fail the operations still running, withdrawing them."""
        for work, (task, _) in list(self._inflight.items()):
            work.finish(WorkError(f"ucxcomm {work.what}: {why} before it completed"))
            task.cancel()

    # ============================================================== closing
    async def _close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._owns_world:
                await self._world.close()
            else:
                self._fail_inflight("the process group was shut down")

    def shutdown(self) -> None:
        """Close the group (torch's ``destroy_process_group`` calls it); idempotent."""
        if self._closed:
            return
        self._lt.remove_closer(self._close)
        try:
            self._lt.run(self._close(), 30.0)
        finally:
            release_loop_thread(self._lt)

    def abort(self) -> None:
        """Drop the group at once (local; pending operations fail)."""
        if self._closed:
            return
        self._closed = True
        self._lt.remove_closer(self._close)
        if self._owns_world:
            self._lt.call(self._world.abort)
        else:
            self._lt.call(self._fail_inflight, "the process group was aborted")
        release_loop_thread(self._lt)


def create_process_group(store: Any, rank: int, size: int,
                         timeout: timedelta) -> ProcessGroupUCXComm:
    """The creator torch calls for ``init_process_group("ucxcomm")`` / ``new_group``."""
    return ProcessGroupUCXComm(store, rank, size, timeout)


def install_shrink_support() -> bool:
    """Let ``torch.distributed.shrink_group`` shrink ucxcomm groups (torch 2.13's
    ``distributed_c10d``; ``import ucxcomm.torch`` calls it). Returns whether it could.

    torch asks the group for its backend (``_validate_shrink_backend_requirements``:
    ``group._get_backend(device)``), calls the backend's ``shrink``, and wraps what it
    returns in a new C++ ``ProcessGroup`` (``_create_shrunk_process_group``:
    ``ProcessGroup._register_backend``, which takes C++ backends only). A group defined
    in Python is its own backend and has no C++ one: torch's own group creation keeps
    such a group as it is (``_new_process_group_helper``: "If the type is a subclass of
    ProcessGroup then return this process group immediately"), and its shrink path has
    no such case. These two wrappers add it, for ucxcomm groups only: the group is its
    own backend, and the group its ``shrink`` returns is the new process group, named
    and described as torch names a shrunk one. Every other backend takes torch's path
    unchanged.
    """
    c10d = dist.distributed_c10d
    validate = getattr(c10d, "_validate_shrink_backend_requirements", None)
    create = getattr(c10d, "_create_shrunk_process_group", None)
    if validate is None or create is None:
        return False
    if getattr(validate, "_ucxcomm", False):
        return True

    def validate_shrink_backend_requirements(group_info: dict) -> Any:
        pg = group_info.get("process_group")
        if isinstance(pg, ProcessGroupUCXComm):
            return pg
        return validate(group_info)

    def create_shrunk_process_group(new_backend: Any, remaining_ranks: list[int],
                                    metadata: dict, is_default_group: bool) -> Any:
        if not isinstance(new_backend, ProcessGroupUCXComm):
            return create(new_backend, remaining_ranks, metadata, is_default_group)
        new_backend._set_group_name(metadata["new_group_name"])
        new_backend._set_group_desc("default:shrunken" if is_default_group else
                                    f"{metadata['original_group_name']}:shrunk")
        return new_backend

    validate_shrink_backend_requirements._ucxcomm = True  # type: ignore[attr-defined]
    c10d._validate_shrink_backend_requirements = validate_shrink_backend_requirements
    c10d._create_shrunk_process_group = create_shrunk_process_group
    return True

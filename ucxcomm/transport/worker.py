"""``Worker``: one process's UCX worker (tag messages and, through its RMA engines,
one-sided operations), driven by the running asyncio loop.

* The tag path (send, receive, probe, request test) calls UCP directly through the cffi
  extension on the ucxx-owned worker and endpoint handles: ucxx's Python request objects
  cost 4-8 us each, a cffi call well under 1 us.
* The worker is a progress source (:mod:`ucxcomm.transport.progress` spins, arms and
  sleeps for it): pending operations live in two tables, posted UCP requests
  (``_reqs``, order irrelevant) and matched-probe receives (``_probes``, in posting
  order, which gives MPI's matching order); :meth:`Worker.poll` tests them all and
  resolves asyncio futures on the loop thread: no notifier thread.
* Receives that must report sender and size use a *matched probe*: probe with removal,
  then receive the message by handle into a buffer chosen once its size is known, so a
  message of unknown size is received exactly once.
* Both UCX contexts (tags here, RMA in :mod:`ucxcomm.transport.rma`) are built from the
  same options: the transport plan (:mod:`ucxcomm.transport.config`) plus the user's
  ``ucx_config``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import numpy as _np

from .. import settings
from ..errors import ClosedError, PeerFailure
from . import _ucx
from ._target import subtarget, target
from .base import FULL_MASK, Link, Peers, Region, Remote, Target, Transport
from .config import Plan, check_lanes, policy_from, prepare
from .endpoint import Endpoint
from .progress import Progress
from .rma import RmaEngines

__all__ = ["Worker"]

log = logging.getLogger(__name__)

# Large buffers from glibc's brk heap move 3-4x slower through UCX's CMA rendezvous than
# mmap'ed ones (8 MiB exchange: 7.7 vs 2.0 ms here), and glibc moves large allocations to
# the heap once a large block has been freed (its dynamic mmap threshold). Pinning the
# threshold (UCXCOMM_MMAP_THRESHOLD, default 1 MiB) keeps every buffer of this size or
# more mmap'ed; 0 leaves malloc alone.
_malloc_tuned = False


def pin_mmap_threshold() -> int | None:
    """Fix glibc's mmap threshold (once per process; see above). Returns the threshold
    set, or None when left alone (not glibc, or disabled)."""
    global _malloc_tuned
    if _malloc_tuned:
        return None
    _malloc_tuned = True
    value = settings.get("UCXCOMM_MMAP_THRESHOLD")
    if value <= 0:
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return None
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD
    if mallopt(m_mmap_threshold, value) != 1:  # pragma: no cover - refused
        return None
    log.debug("glibc mmap threshold pinned to %d bytes", value)
    return value


#: After a peer is declared dead, what already arrived from it is still delivered for
#: this long before its pending operations fail.
PEER_GRACE_S = 0.05
#: Fast-completion sends only below this size: above it UCX uses rendezvous either way,
#: and over TCP the fast-completion variant cut 64 MiB bandwidth from ~2.2 to 0.7 GB/s.
FAST_SEND_MAX = 256 * 1024


class _Op:
    """One pending transport operation, polled by the progress task.

    Attributes default at class level: creating an op on the hot path only sets the
    few that differ (measurably cheaper than initializing every slot).
    """

    req: Any = None  # the UCP request (cdata) while in flight
    is_recv = False
    keep: Any = None  # keeps memory alive while UCX may touch it
    ptr: Any = None  # receive target ("into" ops)
    cap = 0
    device = False
    scratch: Any = None  # (array, pointer) when a message outgrew the buffer
    tag = 0
    mask = FULL_MASK
    alloc = False  # matched-probe op that allocates the buffer on match
    peek = False  # probe op that only watches (does not consume)
    sender_tag = 0
    length = 0
    done = False
    settled: asyncio.Future | None = None
    finish: Callable[[Any], Any] | None = None  # maps the result before it is delivered

    def __init__(self, future: asyncio.Future | None, peers: Peers) -> None:
        self.future: Any = future  # None only until _post_match decides
        self.peers = peers

    def mark_settled(self) -> None:
        self.done = True
        if self.settled is not None and not self.settled.done():
            self.settled.set_result(None)


class Worker(Transport):
    """A UCX context + worker driven by the running asyncio loop (see the module doc).

    Parameters
    ----------
    config : dict, optional
        UCX options for the contexts (``{"TLS": "tcp,self"}``), over the plan's;
        ``UCX_*`` environment variables the plan did not override still apply.
    spin_us : float, optional
        How long an awaiter (then the progress task) spins while operations are pending
        before the worker is armed and the process sleeps on its epoll descriptor
        (``UCXCOMM_SPIN_US``, default 200; 0 never spins).
    plan : Plan, optional
        The transport plan (``ucxcomm.init`` makes one from its arguments); default: the
        plan of the ``UCXCOMM_*`` variables.

    Raises
    ------
    RuntimeError
        No running event loop.
    UnsupportedError
        The default plan cannot be met (``UCXCOMM_TRANSPORT=rdma`` without RDMA...).
    UcxCommError
        UCX could not create the context or worker.
    """

    #: A progress source watched even when nothing is posted (incoming connections).
    watch_idle = True

    def __init__(self, config: dict[str, str] | None = None, *,
                 spin_us: float | None = None, plan: Plan | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._plan = plan if plan is not None else prepare(policy_from())
        self.options = {**self._plan.config, **(config or {})}
        pin_mmap_threshold()
        self._context = _ucx.create_context(self.options)
        self._worker = _ucx.create_worker(self._context)
        self._wh = self._worker.handle
        self._fd = self._worker.epoll_file_descriptor
        self._ffi, self._lib = _ucx.ffi, _ucx.lib
        self._INPROGRESS = self._lib.UCXCOMM_INPROGRESS
        self._req_out = self._ffi.new("void *[1]")
        self._msg_out = self._ffi.new("void *[1]")
        self._tag_out = self._ffi.new("uint64_t[1]")
        self._len_out = self._ffi.new("size_t[1]")
        if spin_us is None:
            spin_us = settings.get("UCXCOMM_SPIN_US")
        self._reqs: list[_Op] = []  # UCP requests in flight (order irrelevant)
        self._probes: list[_Op] = []  # matched-probe receives, in posting order
        self._graveyard: list[Any] = []  # memory of abandoned operations
        self._dead: dict[Any, tuple[float, BaseException]] = {}
        self._closed = False
        self._cuda = bool(self._context.cuda_support)
        self._progress = Progress(self._loop, spin_us * 1e-6, on_cancel=self.abort)
        self._progress.add(self)
        self._rma = RmaEngines(self.options, self._plan.rdma, self._progress, self._loop)
        self.endpoints: list[Endpoint] = []

    # ------------------------------------------------------------------ info
    @property
    def address(self) -> bytes:
        """This worker's UCX address (give it to peers so they can connect)."""
        return bytes(self._worker.address)

    @property
    def cuda_support(self) -> bool:
        return self._cuda

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def plan(self) -> Plan:
        """The transport plan this worker's contexts were built from."""
        return self._plan

    def info(self) -> str:
        return str(self._worker.info)

    # ------------------------------------------------------------------ RMA
    def register(self, buf: Any) -> Region:
        """Register ``buf`` for one-sided access by peers: a
        :class:`~ucxcomm.transport.rma.MemoryRegion` whose ``rkey`` (bytes), ``address``
        and ``nbytes`` a peer passes to :meth:`remote_memory` (or ``ep.remote_memory``).

        Raises
        ------
        TypeError, ValueError
            ``buf`` is not a contiguous writable buffer.
        ClosedError
        """
        self._check_open()
        return self._rma.register(buf)

    def remote_memory(self, rkey: bytes, address: int, nbytes: int) -> Remote:
        """A peer's registered memory: a :class:`~ucxcomm.transport.rma.RemoteMemory`.

        Raises
        ------
        ValueError
            ``rkey`` is not a ucxcomm remote key.
        ClosedError
        """
        self._check_open()
        return self._rma.remote(rkey, address, nbytes)

    # ------------------------------------------------------------ endpoints
    def listen(self, port: int, callback: Callable[[Any], None]) -> Any:
        """A UCX listener; ``callback(conn_request)`` runs during progress (see
        :mod:`ucxcomm.transport.listener` for the public API)."""
        self._check_open()
        return _ucx.create_listener(self._worker, port, callback)

    def connect_sockaddr(self, host: str, port: int) -> Any:
        """A raw UCX endpoint to a listener at ``host:port`` (with UCX error handling)."""
        self._check_open()
        return _ucx.endpoint_from_host(self._worker, host, port)

    def adopt(self, ucx_ep: Any, peer: Any) -> Endpoint:
        """An :class:`Endpoint` around a raw UCX endpoint of this worker."""
        ep = Endpoint(self, ucx_ep, peer)
        self.endpoints.append(ep)
        return ep

    def connect(self, address: bytes, peer: Any = None) -> Link:
        """An :class:`Endpoint` to the worker whose address is ``address``; the plan is
        enforced on the lanes UCX chose (:func:`~ucxcomm.transport.config.check_lanes`).

        UCX peer error handling is deliberately off: it pins endpoints to TCP and loses
        shared memory/CMA; dead peers are detected out of band (:meth:`fail_peer`).

        Raises
        ------
        PeerFailure
            ``transport="rdma"`` and the peer is reachable only without RDMA.
        ClosedError
        """
        self._check_open()
        ep = Endpoint(self, _ucx.endpoint_from_address(self._worker, address), peer)
        if peer is not None:
            try:
                check_lanes(self._plan, peer, ep.transports())
            except BaseException:
                ep.abort()
                raise
        self.endpoints.append(ep)
        return ep

    # ------------------------------------------------------------ operations
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the worker is closed")

    def send_ptr(self, obj: Any) -> Target:
        """``(pointer, nbytes, keepalive, device)`` of a send buffer, validated.

        Raises
        ------
        TypeError, ValueError
            Not a buffer / not contiguous. UnsupportedError: GPU memory without CUDA.
        """
        return target(obj, False, self._cuda)

    def recv_ptr(self, obj: Any) -> Target:
        """Like :meth:`send_ptr` for a receive buffer (must also be writable)."""
        try:  # the common case inline (every receive comes here): see _target.target
            ptr = self._ffi.from_buffer(obj, require_writable=True)
            return ptr, len(ptr), ptr, False
        except (TypeError, ValueError, BufferError):
            return target(obj, True, self._cuda)

    def subtarget(self, t: Target, offset: int, nbytes: int) -> Target:
        """Bytes ``[offset, offset + nbytes)`` of a target from :meth:`send_ptr` /
        :meth:`recv_ptr` (same memory, no copy)."""
        return subtarget(t, offset, nbytes)

    def _dead_error(self, peers: Iterable | None) -> BaseException | None:
        if not self._dead or peers is None:
            return None
        now = time.monotonic()
        for p in peers:
            entry = self._dead.get(p)
            if entry is not None and now >= entry[0]:
                return entry[1]
        return None

    def _track(self, op: _Op) -> asyncio.Future:
        # No wake-up here: the caller either awaits through complete() (which
        # progresses the worker itself) or calls wake() (non-blocking operations).
        self._reqs.append(op)
        return op.future

    def send(self, ep_handle: int, obj: Any, tag: int, peers: Peers,
             fast: bool = False) -> asyncio.Future | None:
        """Post a tag send of buffer ``obj``; ``None`` if it completed at once, else a future.

        ``fast`` requests UCX's fast-completion protocols for messages below
        ``FAST_SEND_MAX`` (a win on shared memory, a loss on TCP: the endpoint decides).
        """
        return self.send_raw(ep_handle, target(obj, False, self._cuda), tag, peers, fast)

    def send_raw(self, ep_handle: int, target: Target, tag: int,
                 peers: Peers, fast: bool = False) -> asyncio.Future | None:
        if self._closed:
            raise ClosedError("the worker is closed")
        if self._dead:
            err = self._dead_error(peers)
            if err is not None:
                raise err
        ptr, nbytes, keep, _ = target
        st = self._lib.ucxcomm_tag_send(ep_handle, ptr, nbytes, tag,
                                        fast and nbytes < FAST_SEND_MAX, self._req_out)
        if st == 0:
            return None
        if st < 0:
            raise _ucx.status_error(st, _first(peers), "send")
        op = _Op(self._loop.create_future(), peers)
        op.req, op.keep = self._req_out[0], keep
        return self._track(op)

    def tag_recv(self, target: Target, tag: int, mask: int = FULL_MASK,
                 peers: Peers = None) -> asyncio.Future | None:
        """Worker-level receive with a tag mask into ``target`` (from :meth:`recv_ptr`);
        ``None`` when it completed at once. Sender and size are not reported."""
        self._check_open()
        ptr, nbytes, keep, _ = target
        st = self._lib.ucxcomm_tag_recv(self._wh, ptr, nbytes, tag, mask,
                                        self._req_out, self._tag_out, self._len_out)
        if st == 0:
            return None
        if st < 0:
            raise _ucx.status_error(st, _first(peers), "receive")
        op = _Op(self._loop.create_future(), peers)
        op.req, op.keep, op.is_recv = self._req_out[0], keep, True
        return self._track(op)

    def stream_send(self, ep_handle: int, target: Target,
                    peers: Peers) -> asyncio.Future | None:
        """Stream bytes to an endpoint (connection handshakes); None if done at once."""
        self._check_open()
        ptr, nbytes, keep, _ = target
        st = self._lib.ucxcomm_stream_send(ep_handle, ptr, nbytes, self._req_out)
        return self._stream_op(st, keep, peers, "stream send")

    def stream_recv(self, ep_handle: int, target: Target,
                    peers: Peers) -> asyncio.Future | None:
        """Receive exactly ``len(target)`` stream bytes from an endpoint."""
        self._check_open()
        ptr, nbytes, keep, _ = target
        st = self._lib.ucxcomm_stream_recv(ep_handle, ptr, nbytes, self._req_out)
        return self._stream_op(st, keep, peers, "stream receive")

    def _stream_op(self, st: int, keep: Any, peers: Peers, what: str
                   ) -> asyncio.Future | None:
        if st == 0:
            return None
        if st < 0:
            raise _ucx.status_error(st, _first(peers), what)
        op = _Op(self._loop.create_future(), peers)
        op.req, op.keep = self._req_out[0], keep  # polled with ucp_request_check_status
        return self._track(op)

    def probe(self, tag: int, mask: int) -> tuple[int, int] | None:
        """Non-destructive probe: ``(sender_tag, nbytes)`` of the first match, or None."""
        self._check_open()
        self._lib.ucxcomm_progress(self._wh)
        if not self._lib.ucxcomm_tag_probe(self._wh, tag, mask, 0, self._msg_out,
                                           self._tag_out, self._len_out):
            return None
        return self._tag_out[0], self._len_out[0]

    def probe_wait(self, tag: int, mask: int, peers: Peers) -> asyncio.Future:
        """Resolve to ``(sender_tag, nbytes)`` once a matching message is there (not consumed)."""
        self._check_open()
        op = _Op(self._loop.create_future(), peers)
        op.tag, op.mask, op.peek = tag, mask, True
        self._probes.append(op)
        self._progress.kick()
        return op.future

    def recv_into(self, target: Target, tag: int, mask: int,
                  peers: Peers, finish: Callable[[Any], Any] | None = None,
                  spin: bool = False) -> tuple[int, int, int] | asyncio.Future:
        """Matched-probe receive of the first message matching (tag, mask) into ``target``
        (from :meth:`recv_ptr`).

        Returns ``(sender_tag, nbytes, capacity)`` when the message was already there and
        is fully received, else a future resolving to the same. If ``nbytes >
        capacity`` the message was consumed and the buffer holds its first ``capacity``
        bytes (the caller reports the truncation). ``finish``, if given, maps the result
        before the *future* delivers it (its exceptions become the future's); an
        immediate tuple result is returned unmapped. ``spin=True`` (for callers about to
        await the result) first waits for the message right here while the event loop
        has nothing else to do.
        """
        self._check_open()
        op = _Op(None, peers)  # type: ignore[arg-type]
        op.tag, op.mask, op.finish = tag, mask, finish
        op.ptr, op.cap, op.keep, op.device = target
        return self._post_match(op, spin)

    def recv_alloc(self, tag: int, mask: int, peers: Peers, spin: bool = False
                   ) -> tuple[int, int, Any] | asyncio.Future:
        """Matched-probe receive into new memory of the message's size (a ``bytearray``
        below 64 KiB, else a ``numpy.uint8`` array).

        Returns (or resolves to) ``(sender_tag, nbytes, buffer)``.
        """
        self._check_open()
        op = _Op(None, peers)  # type: ignore[arg-type]
        op.tag, op.mask, op.alloc = tag, mask, True
        return self._post_match(op, spin)

    def _post_match(self, op: _Op, spin: bool = False) -> Any:
        if not self._probes and (self._try_match(op) or (spin and self._spin_match(op))):
            if op.req is None:  # completed on the spot
                fut = op.future
                if fut is not None:  # completed with an error
                    return fut
                return self._result(op)
            op.future = self._loop.create_future()
            return self._track(op)
        op.future = self._loop.create_future()
        self._probes.append(op)
        return op.future

    def _spin_match(self, op: _Op) -> bool:
        """Wait for ``op``'s message right here while the event loop is idle (only
        called when no earlier receive is pending, so matching order is kept)."""
        return self._progress.spin(self._match_step, op)

    def _match_step(self, op: _Op) -> bool:
        self._lib.ucxcomm_progress(self._wh)
        if self._try_match(op):
            return True
        if self._reqs:
            self._poll()  # others' requests complete meanwhile
        return False

    def _result(self, op: _Op) -> Any:
        if op.alloc:
            return (op.sender_tag, op.length, op.keep[1])
        return (op.sender_tag, op.length, op.cap)

    def _try_match(self, op: _Op) -> bool:
        """Probe for ``op``; on a match start (or finish) its receive. True if matched."""
        lib = self._lib
        if not lib.ucxcomm_tag_probe(self._wh, op.tag, op.mask, 0 if op.peek else 1,
                                     self._msg_out, self._tag_out, self._len_out):
            return False
        stag, nbytes = self._tag_out[0], self._len_out[0]
        if op.peek:
            op.done = True
            if not op.future.done():
                op.future.set_result((stag, nbytes))
            return True
        op.sender_tag, op.length = stag, nbytes
        msg = self._msg_out[0]
        if op.alloc:
            # Small: a bytearray is the cheapest allocation; large: numpy skips zeroing.
            arr = bytearray(nbytes) if nbytes < 65536 else _np.empty(nbytes, dtype=_np.uint8)
            ptr = self._ffi.from_buffer(arr, require_writable=True)
            op.keep = (ptr, arr)
        elif nbytes <= op.cap:
            ptr = op.ptr
        else:  # too large: take it whole into scratch memory, keep the prefix
            if op.device:
                import cupy

                arr = cupy.empty(nbytes, dtype=cupy.uint8)
                ptr = self._ffi.cast("void *", arr.data.ptr)
            else:
                arr = _np.empty(nbytes, dtype=_np.uint8)
                ptr = self._ffi.from_buffer(arr, require_writable=True)
            op.scratch = (arr, ptr)
        st = lib.ucxcomm_msg_recv(self._wh, ptr, nbytes, msg, self._req_out,
                                  self._tag_out, self._len_out)
        op.is_recv = True
        if st == self._INPROGRESS:
            op.req = self._req_out[0]
        else:
            self._complete(op, st)
        return True

    def _complete(self, op: _Op, status: int) -> None:
        op.req = None
        op.mark_settled()
        if status >= 0 and op.scratch is not None:
            self._copy_prefix(op)
        fut = op.future
        if fut is None:  # finished on the spot, before a future existed
            if status < 0:
                op.future = fut = self._loop.create_future()
                fut.set_exception(_ucx.status_error(status, _first(op.peers)))
            return
        if fut.done():
            return
        if status < 0:
            fut.set_exception(_ucx.status_error(status, _first(op.peers)))
        elif op.alloc or op.ptr is not None:
            result = self._result(op)
            if op.finish is not None:
                try:
                    result = op.finish(result)
                except Exception as exc:
                    fut.set_exception(exc)
                    return
            fut.set_result(result)
        else:
            fut.set_result(None)

    def _copy_prefix(self, op: _Op) -> None:
        arr, src = op.scratch
        if op.device:
            import cupy

            dst = int(self._ffi.cast("uintptr_t", op.ptr))
            cupy.cuda.runtime.memcpy(dst, arr.data.ptr, op.cap, 4)  # cudaMemcpyDefault
        else:
            self._ffi.memmove(op.ptr, src, op.cap)
        op.scratch = None

    def cancel(self, fut: asyncio.Future) -> bool:
        """Withdraw the receive behind ``fut`` if it has not matched a message yet.

        Returns True when nothing was (or will be) received for it. An operation that
        already matched (or any send) keeps running so that the message moves whole;
        await :meth:`settle` to know when UCX no longer touches its buffer.
        """
        for i, op in enumerate(self._probes):
            if op.future is fut:
                del self._probes[i]
                op.mark_settled()
                if not fut.done():
                    fut.cancel()
                return True
        for op in self._reqs:
            if (op.future is fut and op.is_recv and op.ptr is None and not op.alloc
                    and op.req is not None):
                # A posted receive: UCP removes it if unmatched (it then completes
                # with UCS_ERR_CANCELED); if matched, it completes normally.
                self._lib.ucxcomm_cancel(self._wh, op.req)
                return False
        return False

    async def settle(self, fut: asyncio.Future) -> None:
        """Return once the UCP request behind ``fut`` has finished (ok, failed or not)."""
        for op in self._reqs:
            if op.future is fut:
                if op.settled is None:
                    op.settled = self._loop.create_future()
                self._progress.kick()
                await asyncio.shield(op.settled)
                return

    def complete(self, fut: asyncio.Future) -> Coroutine[Any, Any, Any]:
        """Await ``fut``, progressing the worker from this task while it waits
        (:meth:`Progress.wait <ucxcomm.transport.progress.Progress.wait>`; returned
        as is: no coroutine frame of our own on the hot path)."""
        return self._progress.wait(fut, self.poll)

    async def drain(self, peers: Peers, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until no send to ``peers`` is in flight."""
        pending = [op for op in self._reqs if not op.is_recv and op.peers == peers
                   and op.future is not None and not op.future.done()]
        if pending:
            self._progress.kick()
            await asyncio.wait([op.future for op in pending], timeout=timeout)

    # ----------------------------------------------------------- peer failure
    def fail_peer(self, peer: Any, exc: BaseException | None = None,
                  grace: float | None = None) -> None:
        """Declare ``peer`` gone: its pending and future operations fail with ``exc``
        (default :class:`PeerFailure`).

        What it sent before dying is still delivered during a grace period
        (``PEER_GRACE_S`` unless given).
        """
        if peer in self._dead:
            return
        if exc is None:
            exc = PeerFailure(f"peer {peer} failed", peer=peer)
        if grace is None:
            grace = PEER_GRACE_S
        self._dead[peer] = (time.monotonic() + grace, exc)
        self._loop.call_later(grace * 1.5, self._progress.kick)
        self._progress.kick()

    def is_dead(self, peer: Any) -> bool:
        return peer in self._dead

    # ------------------------------------------------------------- progress
    def wake(self) -> None:
        """Make sure the progress task runs: call after posting operations that will
        not be awaited through :meth:`complete` right away."""
        self._progress.kick()

    # A progress source (ucxcomm.transport.progress.Source):
    def pending(self) -> bool:
        return bool(self._reqs or self._probes)

    def poll(self) -> int:
        self._lib.ucxcomm_progress(self._wh)
        return self._poll() if (self._reqs or self._probes) else 0

    def arm(self) -> bool:
        progress, wh = self._lib.ucxcomm_progress, self._wh
        while progress(wh):
            pass
        if self._poll():
            return False
        armed = self._lib.ucxcomm_arm(wh)
        if armed < 0:  # pragma: no cover - arming unsupported: sleep on the timer only
            log.debug("ucp_worker_arm failed (%d)", armed)
            return True
        return armed == 1

    def disarm(self) -> None:
        pass  # UCX's arm is one-shot: progress consumes the event

    def fileno(self) -> int:
        return int(self._fd)

    def _poll(self) -> int:
        """Poll every pending operation once; returns how many finished."""
        finished = 0
        if self._reqs:
            test, inprogress = self._lib.ucxcomm_test, self._INPROGRESS
            tag_out, len_out = self._tag_out, self._len_out
            keep = []
            for op in self._reqs:
                req = op.req
                if req is None:  # finished while polled elsewhere
                    continue
                st = test(req, op.is_recv, tag_out, len_out)
                if st != inprogress:
                    self._complete(op, st)
                    finished += 1
                elif self._dead and (err := self._dead_error(op.peers)) is not None:
                    self._abandon(op, err)
                    finished += 1
                else:
                    keep.append(op)
            self._reqs = keep
        if self._probes:
            keep = []
            # (tag, mask) criteria that found nothing this round (only worth tracking when
            # several probes are pending)
            missed: set[tuple[int, int]] | None = set() if len(self._probes) > 1 else None
            for op in self._probes:
                if op.future.done():  # cancelled by its awaiter
                    op.mark_settled()
                    finished += 1
                elif missed and (op.tag, op.mask) in missed and not self._dead:
                    # Nothing arrived since the same criteria missed: skip the probe.
                    keep.append(op)
                elif self._try_match(op):
                    finished += 1
                    if op.req is not None:
                        self._reqs.append(op)
                elif self._dead and (err := self._dead_error(op.peers)) is not None:
                    op.mark_settled()
                    op.future.set_exception(err)
                    finished += 1
                else:
                    if missed is not None:
                        missed.add((op.tag, op.mask))
                    keep.append(op)
            self._probes = keep
        return finished

    def _abandon(self, op: _Op, err: BaseException) -> None:
        # The peer is gone; UCP may never finish this request. Keep its memory alive
        # until the worker is destroyed, and cancel it if it is a receive.
        if op.is_recv and op.req is not None:
            self._lib.ucxcomm_cancel(self._wh, op.req)
        self._graveyard.append((op.req, op.keep))
        op.req = None
        op.mark_settled()
        if not op.future.done():
            op.future.set_exception(err)

    # ---------------------------------------------------------------- close
    def abort(self) -> None:
        """Stop at once: pending operations fail with ClosedError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._progress.close()
        self._rma.close()
        err = ClosedError("the worker was closed")
        lib = self._lib
        for op in self._reqs:
            if op.req is not None:
                lib.ucxcomm_cancel(self._wh, op.req)
        # Give cancelled requests a chance to complete so they can be freed.
        for _ in range(100):
            if not self._reqs:
                break
            lib.ucxcomm_progress(self._wh)
            keep = []
            for op in self._reqs:
                st = lib.ucxcomm_test(op.req, op.is_recv, self._tag_out, self._len_out)
                if st == self._INPROGRESS:
                    keep.append(op)
                else:
                    op.req = None
            self._reqs = keep
        for op in self._reqs + self._probes:
            self._graveyard.append((op.req, op.keep))
            op.mark_settled()
            if not op.future.done():
                op.future.set_exception(err)
                op.future.exception()  # nobody may await it any more: mark retrieved
        self._reqs, self._probes = [], []
        for ep in self.endpoints:
            ep.abort()

    async def close(self) -> None:
        """Let in-flight operations finish (briefly), then release. Idempotent."""
        if self._closed:
            return
        deadline = time.monotonic() + 1.0
        while self._reqs and time.monotonic() < deadline:
            self.poll()
            await asyncio.sleep(0)
        self.abort()
        await self._progress.aclose()

    async def __aenter__(self) -> Worker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _first(peers: Peers) -> Any:
    if peers and len(peers) == 1:
        return next(iter(peers))
    return None

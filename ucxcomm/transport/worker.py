"""``Worker``: one process's UCX worker (tag messages and, through its RMA engines,
one-sided operations), driven by the running asyncio loop.

* The per-message engine is compiled (:class:`ucxcomm.transport._ucp.TagEngine`, Cython
  over ``csrc/tag.c``): posting sends and receives, matched-probe receives in MPI
  matching order, the in-place wait for a prompt message, and one ``poll()`` call that
  progresses UCX and completes every finished operation (futures resolved per batch).
  Its methods are bound onto the worker (see :class:`_Engine`): a send or receive
  crosses into compiled code once. Design and measurements: docs/design.md.
* The worker is a progress source (:mod:`ucxcomm.transport.progress` spins, arms and
  sleeps for it).
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
import os
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, Generic, TypeVar, overload

from .. import settings
from ..errors import ClosedError, PeerFailure
from . import _ucx
from .base import Link, Peers, RecvResult, Region, Remote, Target, Transport
from .config import Plan, check_lanes, policy_from, prepare, ucx_has_cuda
from .counters import Counters
from .endpoint import Endpoint
from .progress import Progress
from .rma import RmaEngines
from .wire import check_address

__all__ = ["Worker"]

F = TypeVar("F", bound=Callable[..., Any])
E = TypeVar("E", bound=Endpoint)

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


# Every worker of this process (a peer's address or key must not name one of them).
_open_workers: weakref.WeakSet[Worker] = weakref.WeakSet()

#: After a peer is declared dead, what already arrived from it is still delivered for
#: this long before its pending operations fail.
PEER_GRACE_S = 0.05

class _Engine(Generic[F]):
    """A method of the compiled engine (``_ucp.TagEngine``) that a :class:`Worker` offers
    as its own: ``Worker.__init__`` binds the engine's method onto the instance, so a
    call costs one crossing into compiled code and no Python frame. The engine's
    docstring says what it does; the contract is :class:`~.base.Transport`'s. Declared
    here (one line each, no second implementation) so that the class has the name, with
    its type, before any worker exists."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Engine[F]: ...
    @overload
    def __get__(self, obj: Worker, owner: type) -> F: ...

    def __get__(self, obj: Worker | None, owner: type) -> Any:
        if obj is None:
            return self
        return getattr(obj._eng, self.name)  # (only before __init__ bound it)


def spin_yield(env: Mapping[str, str] | None = None, cpu_max: str | None = None) -> bool:
    """Whether spinning waiters yield their core on every turn (``UCXCOMM_SPIN_YIELD``;
    auto: when ranks share this rank's CPU, as the launcher that bound it says, or this
    host's ranks outnumber the CPUs a cgroup quota allows; unbound, when this host's
    ranks outnumber this process's cores, or are not known). ``cpu_max``: as for
    :func:`usable_cores`."""
    choice = settings.get("UCXCOMM_SPIN_YIELD", env)
    if choice != "auto":
        return bool(choice)
    local = settings.get("UCXCOMM_LOCAL_SIZE", env)
    per_core = settings.get("UCXCOMM_RANKS_PER_CORE", env)
    if per_core is not None:  # bound: this rank's affinity is its one CPU
        quota = quota_cores(cpu_max)
        return per_core > 1 or (local is not None and quota is not None and local > quota)
    return local is None or local > usable_cores(cpu_max)


def quota_cores(cpu_max: str | None = None) -> int | None:
    """The CPUs a cgroup v2 CPU quota allows (``cpu.max``: ``"<quota> <period>"`` or
    ``"max <period>"``, read from ``/sys/fs/cgroup/cpu.max`` when not given), rounded
    up; None when there is no quota (or it cannot be read)."""
    if cpu_max is None:
        try:
            with open("/sys/fs/cgroup/cpu.max") as f:
                cpu_max = f.read()
        except OSError:
            return None
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return max(1, -(-quota // period)) if quota > 0 and period > 0 else None


def usable_cores(cpu_max: str | None = None) -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU
    quota (:func:`quota_cores`; a container started with ``--cpus=2`` still sees every
    host CPU in its affinity)."""
    cores = len(os.sched_getaffinity(0))
    quota = quota_cores(cpu_max)
    return cores if quota is None else min(cores, quota)


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
        self._carries: str | None = None  # see carry()
        self._plan = plan if plan is not None else prepare(policy_from())
        self.options = {**self._plan.config, **(config or {})}
        pin_mmap_threshold()
        self._context = _ucx.create_context(self.options)
        self._worker = _ucx.create_worker(self._context)
        self._fd = self._worker.epoll_file_descriptor
        # ucxx says CUDA support whenever UCX_TLS allows CUDA transports ("all" by
        # default), even for a UCX built without them (mpich's: UCXCOMM_UCX=mpich).
        self._cuda = bool(self._context.cuda_support) and ucx_has_cuda(_ucx.libucp_path())
        if spin_us is None:
            spin_us = settings.get("UCXCOMM_SPIN_US")
        self._progress = Progress(self._loop, spin_us * 1e-6, on_cancel=self.abort)
        self._spin_yield = spin_yield()
        eng = self._eng = _ucx.ucp.TagEngine()
        eng._engine_setup(self._worker.handle, self._loop, self._progress.ready,
                          self._progress.spin_s, self._cuda, _ucx.status_error,
                          self._progress.others_ready, self._spin_yield)
        for name, attr in vars(Worker).items():  # the _Engine methods: bound once
            if isinstance(attr, _Engine):
                setattr(self, name, getattr(eng, name))
        self.wake = self._progress.kick  # type: ignore[method-assign]  # (per message)
        self._progress.add(self)
        #: Traffic counters per peer (every endpoint with a peer label counts its sends).
        self.counters = Counters(eng)
        self._rma = RmaEngines(self.options, self._plan.rdma, self._progress, self._loop,
                               eng._dead)
        self.endpoints: list[Endpoint] = []
        _open_workers.add(self)

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
        return bool(self._eng._closed)

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

    def allocate(self, nbytes: int) -> Region:
        """``nbytes`` of zeroed memory allocated by UCX for one-sided access: a
        :class:`~ucxcomm.transport.rma.MemoryRegion` whose ``memory`` (a numpy ``uint8``
        array, valid until the region is closed) peers on this host read, write and
        update atomically through shared memory, without this process's help.

        Raises
        ------
        ValueError
            ``nbytes`` is negative.
        ClosedError
        """
        self._check_open()
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        return self._rma.allocate(nbytes)

    def remote_memory(self, rkey: bytes, address: int, nbytes: int,
                      peer: Any = None, *, strict: bool = False) -> Remote:
        """A peer's registered memory: a :class:`~ucxcomm.transport.rma.RemoteMemory`;
        ``peer`` labels its owner (as in :meth:`fail_peer`: once that peer is declared
        dead, operations waiting on the memory raise ``PeerFailure``). ``strict``: the
        key comes from a peer we do not trust to be well-formed (see ``RemoteMemory``).

        Raises
        ------
        ValueError
            ``rkey`` is not a ucxcomm remote key (``strict``: or not one a peer could
            have made for memory of its own).
        ClosedError
        """
        self._check_open()
        return self._rma.remote(rkey, address, nbytes, peer, strict=strict,
                                ours=self.own_addresses() if strict else ())

    # ------------------------------------------------------------ endpoints
    def raw_endpoint(self, address: bytes, *, error_handling: bool = False) -> Any:
        """A raw UCX endpoint to the worker at ``address`` (for :meth:`adopt`), without
        UCX peer error handling unless asked (it keeps UCX off shared memory).

        Raises
        ------
        PeerFailure, UcxCommError
            UCX cannot reach that address. ClosedError.
        """
        self._check_open()
        return _ucx.endpoint_from_address(self._worker, address,
                                          error_handling=error_handling)

    def own_addresses(self) -> tuple[bytes, ...]:
        """This process's UCX addresses that a peer could name: every open worker's and
        every RMA engine's created so far."""
        workers = [w.address for w in list(_open_workers) if not w.closed]
        return (*workers, *self._rma.process_addresses())

    def check_peer_address(self, address: bytes) -> bool:
        """Check a worker address a peer sent before UCX parses it
        (:func:`ucxcomm.transport.wire.check_address`, our address as the template);
        True when it is this worker's own (a connection to ourselves).

        Raises
        ------
        ValueError
            Malformed, or unusable here.
        """
        return check_address(address, self.address, self.own_addresses(), os.getpid())

    def adopt(self, ucx_ep: Any, peer: Any, cls: type[E] = Endpoint) -> E:  # type: ignore[assignment]
        """An endpoint of class ``cls`` (an :class:`Endpoint`, or a subclass such as
        :class:`ucxcomm.pipes.Connection`) around a raw UCX endpoint of this worker."""
        ep = cls(self, ucx_ep, peer)
        self.endpoints.append(ep)
        return ep

    def forget(self, ep: Endpoint) -> None:
        """Drop a closed endpoint from :attr:`endpoints` (it releases its UCX endpoint)."""
        try:
            self.endpoints.remove(ep)
        except ValueError:
            pass

    def connect(self, address: bytes, peer: Any = None, *, other_host: bool = False) -> Link:
        """An :class:`Endpoint` to the worker whose address is ``address``; the plan is
        enforced on the lanes UCX chose (:func:`~ucxcomm.transport.config.check_lanes`).

        UCX peer error handling is off by default: it pins endpoints to TCP and loses
        shared memory/CMA; dead peers are detected out of band (:meth:`fail_peer`). It is
        on for a peer on ``other_host`` when the plan found RDMA: there is no shared
        memory to lose, and without it UCX aborts the process on a queue pair error
        (e.g. ``rc_verbs ... send completion with error`` when this host's link goes
        down, seen over soft-RoCE in ci/softroce/run) instead of failing the endpoint.

        Raises
        ------
        PeerFailure
            ``transport="rdma"`` and the peer is reachable only without RDMA.
        ClosedError
        """
        self._check_open()
        handled = other_host and self._plan.rdma
        ep = Endpoint(self, _ucx.endpoint_from_address(self._worker, address, peer,
                                                       error_handling=handled), peer)
        if peer is not None:
            try:
                check_lanes(self._plan, peer, ep.transports())
            except BaseException:
                ep.abort()
                raise
        self.endpoints.append(ep)
        return ep

    def _check_open(self) -> None:
        if self._eng._closed:
            raise ClosedError("the worker is closed")

    # ------------------------------------------------------------ operations
    # The compiled engine's methods (see _Engine; what each does: _ucp.TagEngine).
    send_ptr: _Engine[Callable[..., Target]] = _Engine()
    recv_ptr: _Engine[Callable[..., Target]] = _Engine()
    subtarget: _Engine[Callable[..., Target]] = _Engine()
    send: _Engine[Callable[..., asyncio.Future | None]] = _Engine()
    send_raw: _Engine[Callable[..., asyncio.Future | None]] = _Engine()
    tag_recv: _Engine[Callable[..., asyncio.Future | None]] = _Engine()
    recv_posted: _Engine[Callable[..., RecvResult | asyncio.Future]] = _Engine()
    probe: _Engine[Callable[..., tuple[int, int] | None]] = _Engine()
    probe_wait: _Engine[Callable[..., asyncio.Future]] = _Engine()
    recv_into: _Engine[Callable[..., RecvResult | asyncio.Future]] = _Engine()
    irecv: _Engine[Callable[..., Any]] = _Engine()
    recv_alloc: _Engine[Callable[..., RecvResult | asyncio.Future]] = _Engine()
    cancel: _Engine[Callable[..., bool]] = _Engine()
    # A progress source (ucxcomm.transport.progress.Source): pending and poll too.
    pending: _Engine[Callable[[], bool]] = _Engine()
    poll: _Engine[Callable[[], int]] = _Engine()

    def carry(self, layout: str) -> None:
        """Declare which of ucxcomm's tag layouts (:mod:`ucxcomm.tags`) this worker
        carries: ``"communicator"`` (a world's ranks) or ``"connections"`` (rank-less
        endpoints). A worker carries one: UCX matches tags across the whole worker, so
        a connection's namespace could overlap a communicator's contexts, and a peer of
        a listener could then address a communicator's receives.

        Raises
        ------
        ValueError
            The worker already carries the other layout.
        """
        if layout not in ("communicator", "connections"):
            raise ValueError(f"unknown tag layout {layout!r}")
        carried = self._carries
        if carried is None:
            self._carries = layout
        elif carried != layout:
            raise ValueError(
                f"this worker carries {carried} messages: UCX matches tags across a "
                f"worker, so it cannot carry {layout} too (connections need a worker of "
                "their own: leave worker= out, or pass a Worker made for them)")

    @property
    def engine(self) -> Any:
        """The compiled tag engine (``_ucp.TagEngine``), for compiled callers that use it
        through its declarations (``ucxcomm/transport/_ucp.pxd``)."""
        return self._eng

    def ep_send(self, ep_handle: int, peers: Peers, fast: bool) -> Any:
        """The compiled ``isend`` of one endpoint (``_ucp.EpSend``: its ``send(obj,
        tag)`` is :meth:`send` with the endpoint's fields, kept current by it)."""
        return self._eng.ep_send(ep_handle, peers, fast)

    def count_senders(self, shift: int, prefixes: Iterable[int], peer: Any) -> None:
        """See :meth:`Transport.count_senders <.base.Transport.count_senders>`."""
        self.counters.route(shift, prefixes, peer)

    def traffic(self, peer: Any) -> dict[str, Any]:
        """See :meth:`Transport.traffic <.base.Transport.traffic>`."""
        handle = next((ep.sender.handle for ep in self.endpoints
                       if ep.peer == peer and not ep.closed), None)
        return self.counters.peer(peer, handle)

    async def settle(self, fut: asyncio.Future) -> None:
        """Return once the UCP request behind ``fut`` has finished (ok, failed or not)."""
        settled = self._eng.settled_future(fut)
        if settled is not None:
            self._progress.kick()
            await asyncio.shield(settled)

    def complete(self, fut: asyncio.Future) -> Coroutine[Any, Any, Any]:
        """Await ``fut``, progressing the worker from this task while it waits
        (:meth:`Progress.wait <ucxcomm.transport.progress.Progress.wait>`; returned
        as is: no coroutine frame of our own on the hot path)."""
        return self._progress.wait(fut, self.poll)

    async def drain(self, peers: Peers, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until no send to ``peers`` is in flight."""
        pending = self._eng.pending_sends(peers)
        if pending:
            self._progress.kick()
            await asyncio.wait(pending, timeout=timeout)

    # ----------------------------------------------------------- peer failure
    def fail_peer(self, peer: Any, exc: BaseException | None = None,
                  grace: float | None = None) -> None:
        """Declare ``peer`` gone: its pending and future operations fail with ``exc``
        (default :class:`PeerFailure`).

        What it sent before dying is still delivered during a grace period
        (``PEER_GRACE_S`` unless given).
        """
        dead = self._eng._dead
        if peer in dead:
            return
        if exc is None:
            exc = PeerFailure(f"peer {peer} failed", peer=peer)
        if grace is None:
            grace = PEER_GRACE_S
        dead[peer] = (time.monotonic() + grace, exc)
        if isinstance(exc, PeerFailure):  # (not a local close: nothing is lost then)
            _ucx.expect_lost_requests()
        self._loop.call_later(grace * 1.5, self._progress.kick)
        self._progress.kick()

    def spin_policy(self) -> tuple[float, bool]:
        return self._progress.spin_s, self._spin_yield

    def is_dead(self, peer: Any) -> bool:
        return peer in self._eng._dead

    def revoke_tags(self, value: int, mask: int, make_err: Callable[[], BaseException]
                    ) -> int:
        """Fail every pending operation whose tag holds ``value`` under ``mask`` with a
        fresh ``make_err()`` each; returns how many (``Comm.revoke``)."""
        n = self._eng.revoke_ops(value, mask, make_err)
        if n:
            _ucx.expect_lost_requests()  # (abandoned sends: UCX may warn at teardown)
            self._progress.kick()
        return n

    def forget_peer(self, peer: Any) -> None:
        """Drop what :meth:`fail_peer` recorded about ``peer``, once nothing will ever
        name it again (a connection's label after its endpoint is released): the
        exception, raised by every operation that failed for it, holds those
        operations' frames and what they referenced (buffers) for as long as it is
        kept."""
        self._eng._dead.pop(peer, None)

    # ------------------------------------------------------------- progress
    def wake(self) -> None:
        """Make sure the progress task runs: call after posting operations that will
        not be awaited through :meth:`complete` right away."""
        self._progress.kick()

    def set_idle_watch(self, on: bool) -> None:
        """See :meth:`Transport.set_idle_watch`."""
        self._progress.idle_watch = on

    # A progress source (ucxcomm.transport.progress.Source; pending and poll above).
    def arm(self) -> bool:
        return bool(self._eng.arm())

    def disarm(self) -> None:
        pass  # UCX's arm is one-shot: progress consumes the event

    def fileno(self) -> int:
        return int(self._fd)

    # ---------------------------------------------------------------- close
    def abort(self) -> None:
        """Stop at once: pending operations fail with ClosedError. Idempotent."""
        eng = self._eng
        if eng._closed:
            return
        eng._closed = True
        self._progress.close()
        self._rma.close()
        eng._abort_ops(ClosedError("the worker was closed"))
        for ep in list(self.endpoints):
            ep.abort()

    async def close(self) -> None:
        """Let in-flight operations finish (briefly), then release. Idempotent."""
        if self._eng._closed:
            return
        deadline = time.monotonic() + 1.0
        while self._eng.pending() and time.monotonic() < deadline:
            self._eng.poll()
            await asyncio.sleep(0)
        self.abort()
        await self._progress.aclose()

    async def __aenter__(self) -> Worker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

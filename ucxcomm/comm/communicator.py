"""``Comm`` (ranks, point-to-point, split/dup, close) and ``World`` (per-process state).

MPI semantics on top of :mod:`ucxcomm.transport` (through the interface of
:mod:`ucxcomm.transport.base`); this module never touches UCX. A ``Comm`` holds the
communicator's :class:`~ucxcomm.comm.group.Group` (what its parts share) and *is* a
:class:`~ucxcomm.comm.collectives.Collectives` (its collectives are its own methods).
Lowercase methods move Python objects (pickle protocol 5, array payloads out of band),
Capitalized methods move raw buffers straight from/into the caller's memory.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .. import settings
from .._deadline import check_timeout, within
from .._serialize import FRAMED, encode, loads_inline
from ..errors import (
    ClosedError,
    CollectiveMismatch,
    CommTimeoutError,
    PeerFailure,
    Revoked,
    TruncationError,
)
from ..tags import (
    ANY_SOURCE,
    ANY_TAG,
    KIND_P2P,
    TAG_UB,
    cid_of,
    split_tag,
)
from . import elastic, trace
from .algorithms import ScratchPool
from .collectives import Collectives
from .group import Group, check_int
from .pool import FramePool
from .request import Request, Status

if TYPE_CHECKING:  # annotations only: importing ucxcomm must not load the transport
    from ..transport.base import Link, RecvResult, Transport


def recv_status(result: RecvResult) -> Status:
    """The :class:`Status` of a finished buffer receive ``(sender_tag, nbytes,
    capacity)``; raises :class:`TruncationError` when the message outgrew the buffer.
    (A function, not a method: the engine calls it per completion.)"""
    stag, nbytes, cap = result
    source, tag = split_tag(stag)
    status = Status(source, tag, nbytes)
    if nbytes > cap:
        raise TruncationError(
            f"message of {nbytes} bytes from rank {status.source} (tag {status.tag}) "
            f"truncated to the {cap}-byte receive buffer",
            nbytes=nbytes, capacity=cap, status=status)
    return status


#: The request of every send that completed when it was posted (immutable: shared).
_SENT = Request.completed()

__all__ = ["Comm", "World"]

log = logging.getLogger(__name__)



def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _unawaited(futs: Any) -> None:
    """The send futures of a call that ends (its receive failed, or it was cancelled)
    without awaiting them: their failure, if any, is retrieved when it comes (the dead
    peer's send fails too: 'Future exception was never retrieved' otherwise, found by
    the elastic fuzzer)."""
    for fut in futs or ():
        if fut is not None:
            fut.add_done_callback(_retrieve)


class World:
    """Per-process state every communicator shares: worker, peer addresses, endpoints.

    Created by :func:`ucxcomm.init`; users never build one.
    """

    def __init__(self, worker: Transport, rank: int, size: int,
                 addresses: list[bytes], hosts: list[bytes] | None = None,
                 trace_part: str = "", members: tuple[int, ...] | None = None,
                 cid: int = 0, lives: dict[int, int] | None = None) -> None:
        worker.carry("communicator")  # (no connection may share its tags)
        self.worker = worker
        self.rank = rank
        self.size = size
        self.addresses = addresses
        #: Each rank's host identity (``_net.host_identity``; empty: unknown), when
        #: the bootstrap exchanged them: endpoints to ranks known to be on another host
        #: may use UCX peer error handling (:meth:`Transport.connect`).
        self.hosts = hosts
        self.next_cid = 1  # 0 is the world communicator
        self._eps: dict[int, Link] = {}
        self.closed = False
        self.closers: list[Callable[[], Awaitable[None]]] = []
        #: Called with the rank (on the event loop) when a peer is declared dead, after
        #: its operations were failed (ucxcomm.torch fails its whole group's collectives).
        self.failure_listeners: list[Callable[[int], None]] = []
        #: World ranks known dead, and why (``Comm.failed``, ``Comm.events``).
        self.dead: set[int] = set()
        self.dead_reason: dict[int, str] = {}
        #: Which process holds each world rank: its life, the count of the rank's joins
        #: to the store (1 unless a replacement took the rank: ``Comm.grow``), and the
        #: deaths of lives not admitted here yet.
        self.lives: dict[int, int] = dict(lives or {})
        self.deaths_ahead: set[tuple[int, int]] = set()
        #: How many joiner entries of the store ``Comm.grow`` has read (the same on every
        #: member of the communicators it grew).
        self.joined_cursor = 0
        #: This process's communicators (a revocation names one by context id).
        self.groups: weakref.WeakSet[Group] = weakref.WeakSet()
        #: The bootstrap store's client (``launch/store.py``: its liveness watch, the
        #: coordinator of ``agree``/``shrink``, the relay of revocations); None in a
        #: world of one process.
        self.store: Any = None
        self.pool = FramePool()
        self.scratch = ScratchPool()
        #: This process's flight recorder (``comm/trace.py``), shared by its communicators.
        #: (``trace_part``: a world of its own within the job, e.g. a torch group's.)
        self.recorder = trace.open_recorder(rank, size, trace_part)
        #: Collectives carry fingerprints (``comm/fingerprint.py``); the same on every rank.
        self.check_collectives = bool(settings.get("UCXCOMM_CHECK_COLLECTIVES"))
        #: Stops the thread that answers ``ucxcomm status --store`` (launch/status.py).
        self.status_stop: Callable[[], None] | None = None
        #: The communicator ``init()`` returns: every rank, context id 0; for a process
        #: that joined a running job (``Comm.grow``), the communicator it was admitted
        #: to (``members``, ``cid``). Closing it closes the world.
        #: Point-to-point messages from this many bytes to ranks of this host take the
        #: engine's split rendezvous (0: off; ``UCXCOMM_P2P_SPLIT``).
        self.split_min = 0
        mine = hosts[rank] if hosts is not None and rank < len(hosts) else b""
        engine = getattr(worker, "engine", None)
        if mine and engine is not None and engine.split_setup(
                rank, self._split_route, settings.get("UCXCOMM_P2P_SPLIT"),
                self._split_sender):
            self.split_min = settings.get("UCXCOMM_P2P_SPLIT")
        self.comm = Comm(self, tuple(range(size)) if members is None else members, cid)
        if members is not None:
            self.next_cid = cid + 1

    def endpoint(self, world_rank: int) -> Link:
        ep = self._eps.get(world_rank)
        if ep is None:
            ep = self.worker.connect(self.addresses[world_rank], peer=world_rank,
                                     other_host=self.other_host(world_rank))
            self._eps[world_rank] = ep
            sender = getattr(ep, "sender", None)
            if self.split_min and self.same_host(world_rank) and sender is not None:
                sender.split = True
                sender.world = world_rank
        return ep

    def _split_route(self, world_rank: int) -> Any:
        """The endpoint's tag sender (``EpSend``) to ``world_rank``, for the engine's
        split rendezvous (which keeps it until it closes)."""
        return self.endpoint(world_rank).sender  # type: ignore[attr-defined]

    def _split_sender(self, stag: int) -> int:
        """The world rank that sent a point-to-point message tagged ``stag`` (-1: no
        communicator of this process has its context), for the engine's split
        rendezvous."""
        cid, (source, _) = cid_of(stag), split_tag(stag)
        for g in list(self.groups):
            if g.cid == cid and source < len(g.members):
                return int(g.members[source])
        return -1

    def same_host(self, world_rank: int) -> bool:
        """Whether ``world_rank`` is known to run on this rank's host."""
        if self.hosts is None or world_rank >= len(self.hosts):
            return False
        mine = self.hosts[self.rank]
        return bool(mine) and mine == self.hosts[world_rank]

    def other_host(self, world_rank: int) -> bool:
        """Whether ``world_rank`` is known to run on another host than this rank."""
        if self.hosts is None:
            return False
        mine, theirs = self.hosts[self.rank], self.hosts[world_rank]
        return bool(mine) and bool(theirs) and mine != theirs

    def peer_failed(self, world_rank: int, quiet: bool = False, life: int | None = None
                    ) -> None:
        """Called when the bootstrap store reports that ``world_rank`` died (``quiet``:
        its process was ending without closing, so its own output says why; what waits
        on it still fails, without a warning here; ``life``: which of the rank's
        processes died, see :meth:`admit`: a predecessor's death is old news, a
        successor's not admitted yet is kept for when it is)."""
        if life is not None and life != self.lives.get(world_rank, 1):
            if life > self.lives.get(world_rank, 1):
                self.deaths_ahead.add((world_rank, life))
            return
        if world_rank == self.rank or self.closed or world_rank in self.dead:
            return
        if quiet:
            log.info("rank %d: peer rank %d exited without closing", self.rank, world_rank)
        else:
            log.warning("rank %d: peer rank %d died or left without closing", self.rank,
                        world_rank)
        reason = f"rank {world_rank} died or left the job without closing"
        self.dead.add(world_rank)
        self.dead_reason[world_rank] = reason
        self.worker.fail_peer(world_rank, PeerFailure(reason, peer=world_rank))
        elastic.publish(self, world_rank, reason)
        for listener in list(self.failure_listeners):
            listener(world_rank)

    def admit(self, world_rank: int, address: bytes, host: bytes, life: int) -> None:
        """A replacement (``life``) now holds ``world_rank`` (``Comm.grow``): its address
        replaces its predecessor's, which is forgotten (endpoint, death)."""
        while len(self.addresses) <= world_rank:
            self.addresses.append(b"")
            if self.hosts is not None:
                self.hosts.append(b"")
        self.size = len(self.addresses)
        # Every communicator with that rank named its predecessor: revoked here (an
        # operation on it would reach the replacement, which knows nothing of it).
        for g in list(self.groups):
            if world_rank in g.members and not g.shut:
                g.replaced.add(world_rank)
                elastic.revoke_local(g, f"rank {g.members.index(world_rank)} was "
                                     "replaced by a new process (grow)")
        old = self._eps.pop(world_rank, None)
        if old is not None:
            old.abort()
        self.addresses[world_rank] = address
        if self.hosts is not None:
            self.hosts[world_rank] = host
        self.lives[world_rank] = life
        self.dead.discard(world_rank)
        self.dead_reason.pop(world_rank, None)
        self.worker.forget_peer(world_rank)
        if (world_rank, life) in self.deaths_ahead:  # (it died before it was admitted)
            self.deaths_ahead.discard((world_rank, life))
            self.peer_failed(world_rank)

    def watch_lost(self, reason: str) -> None:
        """The liveness watch (the bootstrap store) is gone: no death can be reported to
        this rank any more, so waits on any peer could last forever. Every operation on
        a peer fails with PeerFailure (after the usual grace) instead; ``reason`` says
        why in each error."""
        if self.closed:
            return
        for r in range(self.size):
            if r != self.rank:
                self.worker.fail_peer(r, PeerFailure(f"rank {r}: {reason}", peer=r))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.status_stop is not None:
            self.status_stop()
        trace.close_recorder(self.recorder)
        self.pool.clear()
        self.scratch.clear()
        try:
            for ep in self._eps.values():
                ep.abort()
            await self.worker.close()
        finally:
            for closer in self.closers:
                try:
                    await closer()
                except Exception:  # pragma: no cover - best effort at shutdown
                    log.debug("close hook failed", exc_info=True)

    def abort(self) -> None:
        self.closed = True
        if self.status_stop is not None:
            self.status_stop()
        trace.close_recorder(self.recorder)
        self.worker.abort()


class Comm(Collectives):
    """A communicator: a group of ranks with its own message space.

    Point-to-point methods are defined here; the collectives (``barrier``, ``bcast``,
    ``Allreduce``, ``Iallreduce``...) are inherited from
    :class:`~ucxcomm.comm.collectives.Collectives` (``collectives.COLLECTIVES`` lists
    them).

    Obtain the world with ``await ucxcomm.init()``; derive others with :meth:`split`
    and :meth:`dup`. Attributes ``rank`` and ``size`` are this process's rank in the
    communicator and the number of ranks.

    Every blocking call takes ``timeout=`` (seconds; None: no limit) and raises
    :class:`~ucxcomm.CommTimeoutError` past it. A collective that timed out leaves the
    ranks' collectives out of step: the communicator then takes no further collective
    (each raises ``UcxCommError`` at the call), while point-to-point keeps working.
    """

    def __init__(self, world: World, members: tuple[int, ...], cid: int) -> None:
        g = Group(world, members, cid)
        Collectives.__init__(self, g)  # (sets _group, _transport, rank, size, _check_open)
        # The per-message paths below read these directly (one attribute, no chain).
        self._world = world
        self._eps = g.eps  # connected endpoints (None: connect with _ep)
        self._ep = g.endpoint
        self._match = g.match
        self._p2p_base = g.p2p_base
        self._frame_seq = g.frame_seq
        self._check_peer = g.check_peer
        self._check_tag = g.check_tag
        self._check_recv = g.check_recv
        self._await_recv = g.await_recv
        self._post_recv_obj = g.post_recv_obj
        self._finish_recv_obj = g.finish_recv_obj
        # Send/Isend and Recv/Irecv: one compiled call each in the common case
        # (comm/_fast.pyx), which falls back on _post_send / _recv_slow.
        from . import _fast

        self._status = _fast.RECV_STATUS
        fast = self._p2p = _fast.P2P(self)
        self._send_now = fast.send
        self._recv_now = fast.recv
        self._rec = world.recorder

    def __repr__(self) -> str:
        return self._group.label

    @property
    def group(self) -> Group:
        """This communicator's :class:`~ucxcomm.comm.group.Group`: its member ranks
        (``group.members``, world ranks) and what its point-to-point, collectives and
        windows share (for ucxcomm's own modules; ``Comm``'s methods are the API)."""
        return self._group

    def trace(self) -> list[trace.Op]:
        """This process's last operations on this communicator, oldest first, from its
        flight recorder (:mod:`ucxcomm.comm.trace`; ``UCXCOMM_TRACE_DEPTH`` records per
        process, shared by its communicators, those still in flight always kept): each a
        :class:`~ucxcomm.comm.trace.Op` with kind, state (posted, waiting, done, failed,
        cancelled), peer or root, tag, sequence number, start and end. Readable after
        the communicator closed (its last records)."""
        data = self._world.recorder.snapshot()
        if not data:
            return []
        cid = self._group.cid
        return [o for o in trace.parse(data)[1] if o.cid == cid]

    def stats(self) -> dict[str, Any]:
        """Traffic counters: per peer rank of this communicator, what this process sent
        to and received from it, and per window made over this communicator, its
        one-sided calls. A plain dict (``json.dumps`` takes it)::

            {"rank": 0, "size": 2,
             "peers": {1: {"world_rank": 1, "lanes": ["sysv/memory", "cma/memory"],
                           "sent": {"messages", "bytes", "eager", "rendezvous",
                                    "unclassified", "lanes", "protocols"},
                           "received": {... the same, and "unexpected"}}},
             "windows": [Win.stats(), ...]}

        ``eager``, ``rendezvous``, ``unclassified``, ``unexpected`` and each entry of
        ``lanes`` (by lane) are ``{"messages": int, "bytes": int}``; ``protocols`` lists
        the rows of UCX's protocol table that counted messages (``variant``, ``sizes``,
        ``protocol``, ``lane``, ``messages``, ``bytes``).

        What the numbers mean (docs/debugging.md, "Counters"):

        * Counters are per process and peer, not per communicator: a peer's endpoint
          is shared by every communicator, so each communicator over the same peers
          reports the same numbers. They count every tag message: user sends and
          receives, the collectives' messages and object frames, the library's own.
        * A message is *sent* when posted to UCX (a send that then fails counts too),
          *received* when it matched a receive. *Unexpected*: the receive found its
          message already arrived (UCX had queued it before the receive was made).
        * *Eager* / *rendezvous* and the lane: the row of UCX's protocol table of the
          peer's endpoint that the message's size falls in (``ucp_ep_print_info``; the
          selection UCX made for that size, not a per-message report). Device memory,
          and endpoints without such a table (``UCX_PROTO_ENABLE=n``), count as
          *unclassified*. ``lanes`` (per peer): every lane of the endpoint
          (``ucp_ep_query``), empty when this rank has no endpoint to it.

        Windows: see :meth:`ucxcomm.Win.stats`. Readable after the communicator or
        the world was closed.
        """
        g = self._group
        transport = self._transport
        peers: dict[int, Any] = {}
        for r, w in enumerate(g.members):
            counted = transport.traffic(w) or {}
            ep = g.eps[r]
            lanes = []
            if ep is not None:
                try:
                    lanes = [f"{tl}/{dev}" for tl, dev in ep.transports()]
                except ClosedError:
                    pass
            peers[r] = {"world_rank": w, "lanes": lanes, **counted}
        g.windows[:] = [ref for ref in g.windows if ref() is not None]
        wins = [win.stats() for win in (ref() for ref in g.windows) if win is not None]
        return {"rank": self.rank, "size": self.size, "peers": peers, "windows": wins}

    # ------------------------------------------------------- buffer messages
    def _post_send(self, buf: Any, dest: Any, tag: Any) -> Any:
        if self._group.closed or self._world.closed:
            self._group.check_open()  # (ClosedError, or Revoked)
        if type(dest) is not int or not 0 <= dest < self.size:
            dest = self._check_peer(dest, "dest")
        if type(tag) is not int or not 0 <= tag <= TAG_UB:
            tag = self._check_tag(tag)
        ep = self._eps[dest]
        if ep is None:
            ep = self._ep(dest)
        return ep.isend(buf, self._p2p_base | tag)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` to ``dest``; returns a :class:`Request` (awaiting it
        gives None once ``buf`` may be reused).

        Raises
        ------
        ValueError, TypeError
            Bad buffer, rank or tag (before anything is sent).
        ClosedError, PeerFailure
        """
        fut = self._send_now(buf, dest, tag)
        if fut is None:
            return _SENT
        self._transport.wake()
        token = self._p2p.token
        return Request(fut, self._transport, None, None, self._rec if token else None, token)

    async def Send(self, buf: Any, dest: int, tag: int = 0, *,
                   timeout: float | None = None) -> None:
        """Send the raw bytes of ``buf`` to ``dest``; returns when ``buf`` may be reused.

        Like ``MPI_Send``, a large message may wait until the receiver posts its
        receive.

        Raises
        ------
        ValueError, TypeError
            Bad buffer, rank or tag (before anything is sent).
        ClosedError, PeerFailure, CommTimeoutError
        """
        if timeout is not None:
            check_timeout(timeout, "Send")
        fut = self._send_now(buf, dest, tag)
        if fut is not None:
            token = self._p2p.token
            try:
                if timeout is None:
                    await self._transport.complete(fut)
                else:
                    await within(self._transport.complete(fut), timeout, "Send")
            except BaseException as exc:
                trace.ended(self._rec, token, exc)
                raise
            self._rec.end(token)

    def _post_recv(self, buf: Any, source: Any, tag: Any, kind: int = KIND_P2P,
                   spin: bool = False, finish: Any = None, post: bool = False) -> Any:
        target = self._transport.recv_ptr(buf)  # validates the buffer first
        if (self._group.closed or type(source) is not int or type(tag) is not int
                or not -1 <= source < self.size or not -1 <= tag <= TAG_UB):
            source, tag = self._check_recv(source, tag)  # raises, or normalizes
        elif self._world.closed:
            raise ClosedError(f"{self!r} is closed")
        return self._transport.recv_into(target, *self._match(kind, source, tag), finish,
                                         spin, post)

    def _recv_slow(self, buf: Any, source: Any, tag: Any, spin: bool, post: bool) -> Any:
        """``Recv``/``Irecv`` when the p2p path does not serve them: checks (raising),
        then the match (cached for the next call) and the receive; the result is the
        path's (``recv_status`` applied to a future's)."""
        return self._post_recv(buf, source, tag, KIND_P2P, spin, self._status, post)

    async def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, *,
                   timeout: float | None = None) -> Status:
        """Receive a message straight into ``buf``; returns its :class:`Status`.

        Raises
        ------
        TruncationError
            The message was larger than ``buf`` (it is consumed; ``buf`` holds its
            first ``len(buf)`` bytes).
        ValueError, TypeError
            Non-contiguous or read-only buffer, bad rank or tag.
        ClosedError, PeerFailure, CommTimeoutError
        """
        if timeout is not None:
            check_timeout(timeout, "Recv")
        # One crossing in the common case; it waits in place (spin), not posted to UCX
        # (a truncated message keeps its prefix).
        res = self._recv_now(buf, source, tag, True, False)
        if type(res) is Status:
            return res
        if type(res) is tuple:
            return recv_status(res)  # (raises TruncationError)
        token = self._p2p.token
        try:
            if timeout is None:
                status = await self._await_recv(res)
            else:
                status = await within(self._await_recv(res), timeout, "Recv")
        except BaseException as exc:
            trace.ended(self._rec, token, exc)
            raise
        self._rec.end(token)
        return status  # type: ignore[no-any-return]

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Start receiving into ``buf``; awaiting the request gives a :class:`Status`.

        ``req.cancel()`` withdraws it if no message matched yet. A receive that has to
        wait for its message is handed to UCX's own matching (the data then lands in
        ``buf`` directly); a message that outgrows ``buf`` then raises
        :class:`~ucxcomm.TruncationError` with ``buf`` left unwritten (a ``Recv``, a
        message that was already there, or one from this host of ``UCXCOMM_P2P_SPLIT``
        bytes or more leaves its prefix).
        """
        res = self._recv_now(buf, source, tag, False, True)
        if type(res) is Status:
            return Request(None, None, None, res)
        if type(res) is tuple:
            try:
                return Request.completed(recv_status(res))
            except TruncationError as exc:
                return Request.failed(exc)
        transport = self._transport
        transport.wake()
        token = self._p2p.token
        return Request(res, transport, None, None, self._rec if token else None, token)

    # ------------------------------------------------------- object messages
    async def send(self, obj: Any, dest: int, tag: int = 0, *,
                   timeout: float | None = None) -> None:
        """Send a picklable object (array payloads go out of band, without copies).

        Raises
        ------
        ValueError, TypeError
            Bad rank or tag, or ``obj`` cannot be pickled (before anything is sent).
        ClosedError, PeerFailure, CommTimeoutError
        """
        if timeout is not None:
            check_timeout(timeout, "send")
        self._check_open()
        if type(dest) is not int or not 0 <= dest < self.size:
            dest = self._check_peer(dest, "dest")
        if type(tag) is not int or not 0 <= tag <= TAG_UB:
            tag = self._check_tag(tag)
        message, frames = encode(obj, self._frame_seq[dest])  # TypeError before any I/O
        if not frames:  # fast path: one message
            ep = self._eps[dest]
            if ep is None:
                ep = self._ep(dest)
            fut = ep.isend(message, self._p2p_base | tag)
            if fut is None:
                self._record("send", dest, tag, trace.DONE)
                return
            futs = [fut]
        else:
            futs = [f for f in self._group.send_framed(message, frames, dest, KIND_P2P, tag)
                    if f is not None]
            if not futs:
                self._record("send", dest, tag, trace.DONE)
                return
        token = self._record("send", dest, tag, trace.WAITING)
        if len(futs) == 1:
            done: Any = self._transport.complete(futs[0])
        else:
            self._transport.wake()
            done = asyncio.gather(*futs)
        await within(trace.follow(self._world.recorder, token, done), timeout, "send")

    def _record(self, kind: str, peer: int, tag: int, state: int) -> int:
        """Start the flight record of point-to-point ``kind``; its token."""
        g = self._group
        return g.world.recorder.start(kind, state, g.cid, self.rank, self.size, -1, peer,
                                      g.members[peer] if peer >= 0 else peer, tag)

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        """Start sending an object; returns a :class:`Request`."""
        self._check_open()
        dest = self._check_peer(dest, "dest")
        tag = self._check_tag(tag)
        futs = [f for f in self._group.post_send_obj(obj, dest, KIND_P2P, tag) if f is not None]
        if not futs:
            return Request.completed()
        self._transport.wake()
        return Request(futs[0] if len(futs) == 1 else asyncio.gather(*futs))

    async def recv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *,
                   return_status: bool = False, timeout: float | None = None) -> Any:
        """Receive an object; with ``return_status=True`` returns ``(obj, status)``.

        Raises
        ------
        ClosedError, PeerFailure, CommTimeoutError
        """
        if timeout is not None:
            check_timeout(timeout, "recv")
        source, tag = self._check_recv(source, tag)
        res = self._post_recv_obj(source, KIND_P2P, tag, spin=True)
        if type(res) is tuple:  # fast path: a small object that was already here
            obj = loads_inline(res[2])
            if obj is not FRAMED:
                self._record("recv", source, tag, trace.DONE)
                if return_status:
                    src, utag = split_tag(res[0])
                    return obj, Status(src, utag, res[1])
                return obj
        token = self._record("recv", source, tag, trace.WAITING)
        obj, status = await within(trace.follow(self._world.recorder, token,
                                                self._finish_recv_obj(res)), timeout, "recv")
        return (obj, status) if return_status else obj

    def irecv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Start receiving an object; awaiting the request gives the object.

        ``req.cancel()`` withdraws it if no message matched yet.
        """
        source, tag = self._check_recv(source, tag)
        res = self._post_recv_obj(source, KIND_P2P, tag)
        self._transport.wake()
        task = asyncio.ensure_future(self._irecv_obj(res))
        if isinstance(res, tuple):
            return Request(task)
        fut = res
        # The task itself withdraws or settles the receive when cancelled.
        return Request(task, canceller=lambda: self._transport.cancel(fut))

    async def _irecv_obj(self, res: Any) -> Any:
        return (await self._finish_recv_obj(res))[0]

    async def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0,
                       source: int = ANY_SOURCE, recvtag: int = ANY_TAG, *,
                       return_status: bool = False, timeout: float | None = None) -> Any:
        """Send ``sendobj`` to ``dest`` and receive one object, without deadlock."""
        if timeout is not None:
            check_timeout(timeout, "sendrecv")
        self._check_open()
        dest = self._check_peer(dest, "dest")
        sendtag = self._check_tag(sendtag)
        source, recvtag = self._check_recv(source, recvtag)
        futs = [f for f in self._group.post_send_obj(sendobj, dest, KIND_P2P, sendtag)
                if f is not None]
        rres = self._post_recv_obj(source, KIND_P2P, recvtag)
        self._transport.wake()

        async def both() -> tuple[Any, Status]:
            try:
                got = await self._finish_recv_obj(rres)
            except BaseException:
                _unawaited(futs)
                raise
            if futs:
                await asyncio.gather(*futs)
            return got

        obj, status = await within(both(), timeout, "sendrecv")
        return (obj, status) if return_status else obj

    async def Sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int = ANY_SOURCE,
                       sendtag: int = 0, recvtag: int = ANY_TAG, *,
                       timeout: float | None = None) -> Status:
        """Buffer form of :meth:`sendrecv`; returns the receive's :class:`Status`."""
        if timeout is not None:
            check_timeout(timeout, "Sendrecv")
        rtarget = self._transport.recv_ptr(recvbuf)
        source, recvtag = self._check_recv(source, recvtag)
        sfut = self._post_send(sendbuf, dest, sendtag)
        rres = self._transport.recv_into(rtarget, *self._match(KIND_P2P, source, recvtag),
                                         None, False, True)
        self._transport.wake()

        async def both() -> Status:
            try:
                res = rres if isinstance(rres, tuple) else await self._await_recv(rres)
            except BaseException:
                _unawaited([sfut])
                raise
            if sfut is not None:
                await sfut
            return recv_status(res)

        return await within(both(), timeout, "Sendrecv")

    # ------------------------------------------------------------------ probe
    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        """The :class:`Status` of a matching message that is ready, else None (no wait)."""
        source, tag = self._check_recv(source, tag)
        utag, mask, _ = self._match(KIND_P2P, source, tag)
        got = self._transport.probe(utag, mask)
        return None if got is None else Group.status(*got)

    async def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *,
                    timeout: float | None = None) -> Status:
        """Wait until a matching message is ready; returns its :class:`Status`.

        The message is not received. For objects, ``nbytes`` is the size of the first
        part (header and in-band pickle) only.
        """
        if timeout is not None:
            check_timeout(timeout, "probe")
        source, tag = self._check_recv(source, tag)
        fut = self._transport.probe_wait(*self._match(KIND_P2P, source, tag))
        got = await within(self._await_recv(fut), timeout, "probe")
        return Group.status(*got)

    # ----------------------------------------------------------- communicators
    async def split(self, color: int | None, key: int = 0, *,
                    timeout: float | None = None) -> Comm | None:
        """Partition the ranks by ``color``; order each part by ``(key, rank)``.

        Collective. Ranks passing ``color=None`` get None. The new communicators never
        match messages of this one, nor of each other.

        Raises
        ------
        ValueError, TypeError
            ``color`` is negative or not an int/None; ``key`` is not an int; a bad
            ``timeout``.
        CommTimeoutError
            Not every rank took part within ``timeout`` seconds (this communicator then
            takes no further collective).
        """
        self._check_open()
        if color is not None:
            color = check_int(color, "color")
            if color < 0:
                raise ValueError(f"color must be >= 0 or None, got {color}")
        key = check_int(key, "key")
        world = self._world
        mine = (color, key, world.next_cid)
        infos = await self.allgather(mine, timeout=timeout)
        cid = max(info[2] for info in infos)
        world.next_cid = cid + 1
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k, _) in enumerate(infos) if c == color)
        return Comm(world, tuple(self._group.members[r] for _, r in members), cid)

    async def dup(self, *, timeout: float | None = None) -> Comm:
        """A communicator with the same ranks and a separate message space (collective;
        ``timeout`` as for :meth:`split`)."""
        sub = await self.split(0, self.rank, timeout=timeout)
        assert sub is not None
        return sub

    # ------------------------------------------------------ elastic membership
    def failed(self) -> frozenset[int]:
        """The ranks of this communicator that this process knows are dead (local: no
        communication; ``agree`` gives every member the same set)."""
        dead, g = self._world.dead, self._group
        return frozenset(r for r, m in enumerate(g.members) if m in dead or m in g.replaced)

    def revoke(self) -> None:
        """Revoke the communicator, on every member: their pending and later operations
        on it (point-to-point, collectives, requests, windows made from it) raise
        :class:`~ucxcomm.Revoked` soon after. Local: returns at once. Other
        communicators are untouched; revoking again does nothing. ``agree``, ``shrink``
        and ``close`` still work on a revoked communicator (docs/elastic.md).

        Raises
        ------
        ClosedError
            This process closed the communicator.
        """
        elastic.revoke(self)

    @property
    def revoked(self) -> bool:
        """Whether the communicator was revoked (by any member)."""
        return self._group.revoked is not None

    async def agree(self, flag: bool = True, *, timeout: float | None = None
                    ) -> tuple[bool, frozenset[int]]:
        """Fault-tolerant agreement among the live members: ``(ok, failed)``, where
        ``ok`` is the AND of the live members' ``flag`` and ``failed`` the ranks gone
        when it was decided, the same on every member that returns. Collective over the
        live members; ends whatever the timing of deaths (members dying during it
        included); works on a revoked communicator.

        Raises
        ------
        TypeError
            ``flag`` is not a bool.
        ClosedError
            This process closed the communicator.
        CommTimeoutError
            Not every live member took part within ``timeout`` seconds.
        PeerFailure
            The bootstrap store, which coordinates the agreement, is gone.
        """
        return await elastic.agree(self, flag, timeout)

    async def shrink(self, *, timeout: float | None = None) -> Comm:
        """A communicator of the surviving members, ranks in their old order, with a
        fresh message space (collective over the live members, as :meth:`agree`; works
        on revoked and failed communicators). Survivors keep their endpoints (shared
        memory and CMA lanes included): nothing reconnects.

        Raises
        ------
        ClosedError, CommTimeoutError, PeerFailure
            As for :meth:`agree`.
        """
        return await elastic.shrink(self, timeout)

    async def grow(self, size: int | None = None, *, timeout: float | None = None
                   ) -> Comm:
        """A communicator of the live members and of processes waiting to join, until it
        has ``size`` members (default: the original size, for a communicator made by
        :meth:`shrink` that of the one it was shrunk from: each dead member replaced).
        Collective over the live members (as :meth:`agree`). The joiners are processes
        waiting in ``ucxcomm.init()``: replacements that ``ucxcomm run --elastic
        --max-restarts K`` starts for dead ranks; their ``init()`` returns the same new
        communicator. Ranks are ordered by world rank: survivors of the world keep theirs,
        and a replacement of rank ``r`` takes rank ``r``. Waits until enough joiners came
        (``timeout``); ``events()`` of this communicator report ``PeerJoined``. Every
        communicator that had a replaced member is revoked here (its rank now names
        another process; ``failed()`` keeps naming it).

        Raises
        ------
        TypeError
            ``size`` is not an int.
        ValueError
            ``size`` is below the number of live members.
        ClosedError, CommTimeoutError, PeerFailure
            As for :meth:`agree`.
        """
        return await elastic.grow(self, size, timeout)

    def events(self) -> AsyncIterator[elastic.PeerFailed | elastic.PeerJoined]:
        """``async for event in comm.events()``: :class:`ucxcomm.PeerFailed` ``(rank,
        reason)`` for each member that dies (those known dead already come first) and
        :class:`ucxcomm.PeerJoined` ``(rank)``, as they happen; ends when the
        communicator is closed. Each call is an iterator of its own."""
        return elastic.events(self)

    # --------------------------------------------------------------- info/close
    def transport_info(self) -> dict[int, list[tuple[str, str]]]:
        """The UCX (transport, device) lanes to each peer rank of this communicator."""
        self._check_open()
        return {r: self._ep(r).transports() for r in range(self.size)}

    @property
    def closed(self) -> bool:
        """Whether this process closed the communicator (or the world)."""
        return self._group.shut or self._world.closed

    async def close(self, *, timeout: float | None = 60.0) -> None:
        """Collective: wait for every rank, then release. Closing the world communicator
        finalizes ucxcomm in this process. Idempotent.
        """
        if self.closed:
            return
        g = self._group
        try:
            if g.out_of_step is not None:
                raise CommTimeoutError(g.out_of_step)
            if g.revoked is None and not self.failed():
                await self.barrier(timeout=timeout)
        except (PeerFailure, CommTimeoutError, CollectiveMismatch, Revoked) as exc:
            # (a mismatch: a rank gave up on a collective the others never joined)
            log.warning("close: not every rank reached close (%s); closing anyway", exc)
        finally:
            self._shut()
            if self is self._world.comm:
                await self._world.close()

    def abort(self) -> None:
        """Close at once, without waiting for other ranks (safe in ``finally``)."""
        self._shut()
        if self is self._world.comm:
            self._world.abort()

    def _shut(self) -> None:
        g = self._group
        g.closed = g.shut = True
        elastic.end_events(g)

    async def __aenter__(self) -> Comm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is None:
            await self.close()
        else:
            self.abort()

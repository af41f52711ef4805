"""``Group``: the state of one communicator that point-to-point, collectives and windows share.

A :class:`~ucxcomm.Comm` composes a :class:`Group` (members, context id, endpoints,
argument checks, tag matching, collective sequence numbers, object messages) with a
:class:`~ucxcomm.comm.collectives.Collectives` over it; windows reach the transport
through it too. Everything the transport offers is typed by
:mod:`ucxcomm.transport.base`, the only transport module this package depends on.
"""

from __future__ import annotations

import asyncio
import functools
import numbers
import weakref
from typing import TYPE_CHECKING, Any, TypeAlias

from .._serialize import FRAMED, Header, loads_inline, recv_object, send_encoded, send_object
from ..errors import ClosedError, Revoked, UcxCommError
from ..tags import (
    ANY_SOURCE,
    ANY_TAG,
    FULL_MASK,
    KIND_FRAMES,
    KIND_P2P,
    MAX_CID,
    SENDER_SHIFT,
    TAG_UB,
    make_mask,
    make_tag,
    sender_prefixes,
    split_tag,
)
from .request import Status

if TYPE_CHECKING:  # annotations only: importing ucxcomm must not load the transport
    from ..transport.base import Link, Peers, RecvResult, Transport
    from .algorithms import ScratchPool
    from .communicator import World

__all__ = ["Group", "check_int"]

#: A posted receive: its result when it finished at once, else the future to await.
Posted: TypeAlias = "RecvResult | asyncio.Future"


def check_int(value: Any, what: str) -> int:
    """``value`` as an int (``bool`` is refused), else ``TypeError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


class Group:
    """One communicator's members and message space, shared by its parts.

    Attributes
    ----------
    world : World
        The per-process state (transport, peer addresses, memory pools).
    transport : Transport
        The process's worker, as :mod:`ucxcomm.transport.base` describes it.
    scratch : ScratchPool
        The world's scratch buffers for collectives.
    members : tuple of int
        World rank of each communicator rank.
    cid : int
        Context id: the communicator's own tag space.
    rank, size : int
        This process's rank in the communicator, and the number of ranks.
    peers_all : frozenset
        Every member (a receive that depends on all of them fails if any dies).
    peer_sets : list of frozenset
        ``peer_sets[r]``: the peers a receive from rank ``r`` depends on.
    eps : list
        Endpoint to each rank once connected (see :meth:`endpoint`).
    p2p_base : int
        This rank's point-to-point send tag with user tag 0 (OR the tag in).
    frame_seq : list of int
        Next payload-frame sequence number towards each rank.
    closed : bool
        Set when the communicator takes no further operation: closed by this process
        (``shut``), or revoked (``revoked``); the world closing counts too (see
        :meth:`check_open`). The hot paths test this one flag.
    shut : bool
        Set when this process closed (or aborted) the communicator.
    revoked : str or None
        Why the communicator was revoked (``Comm.revoke``, by any member), else None:
        its operations then raise :class:`~ucxcomm.Revoked`.
    ft_seq : int
        The number of ``agree``/``shrink`` calls on the communicator so far (names
        their decisions: the same on every member).
    listeners : list
        The queues of its ``events()`` iterators.
    lives : tuple of int
        Which process of each member's rank the communicator is among (its life:
        ``World.lives``), for the store's decisions.
    replaced : set of int
        Members (world ranks) whose process a replacement took over (``grow``): they
        count as failed here, and the communicator was revoked.
    origin_size : int
        The size ``grow()`` restores by default: the communicator's own, or for one made
        by ``shrink``/``grow``, that of the one it came from (resp. the size grown to).
    label : str
        How the communicator names itself in messages and ``repr``.
    check : bool
        Collectives carry fingerprints (``UCXCOMM_CHECK_COLLECTIVES``,
        :mod:`ucxcomm.comm.fingerprint`).
    out_of_step : str or None
        Why the communicator takes no further collective (a collective of it timed
        out: the ranks' collectives are out of step), else None.
    windows : list of weakref
        The windows made over the communicator (``Comm.stats`` reports them).
    match_cache : dict
        ``(kind, source, tag) -> (ucx_tag, mask, peers)`` of receives checked before
        (:meth:`match`; the compiled point-to-point path reads it).
    """

    __slots__ = (
        "__weakref__",
        "_coll_seq",
        "check",
        "cid",
        "closed",
        "eps",
        "frame_seq",
        "ft_seq",
        "label",
        "listeners",
        "lives",
        "match_cache",
        "members",
        "origin_size",
        "out_of_step",
        "p2p_base",
        "peer_sets",
        "peers_all",
        "rank",
        "replaced",
        "revoked",
        "scratch",
        "seq_wraps",
        "shut",
        "size",
        "transport",
        "windows",
        "world",
    )

    def __init__(self, world: World, members: tuple[int, ...], cid: int) -> None:
        if cid > MAX_CID:
            raise RuntimeError(f"too many communicators (context id {cid} > {MAX_CID})")
        self.world = world
        self.transport: Transport = world.worker
        self.scratch: ScratchPool = world.scratch
        self.members = members
        self.cid = cid
        self.rank = members.index(world.rank)
        self.size = len(members)
        self.peers_all = frozenset(members)
        self.peer_sets = [frozenset((m,)) for m in members]
        self.eps: list[Link | None] = [None] * self.size
        self.p2p_base = make_tag(cid, KIND_P2P, self.rank, 0)
        self.frame_seq = [0] * self.size
        self.closed = False
        self.shut = False
        self.revoked: str | None = None
        self.ft_seq = 0
        self.origin_size = len(members)
        self.replaced: set[int] = set()
        self.lives = tuple(world.lives.get(m, 1) for m in members)
        self.listeners: list[asyncio.Queue] = []
        self.label = f"<ucxcomm.Comm cid={cid} rank={self.rank} size={self.size}>"
        self._coll_seq = 0
        #: How often the sequence numbers wrapped (``comm/shm.py`` counts calls over the
        #: communicator's life: ``seq_wraps << TAG_BITS | seq``).
        self.seq_wraps = 0
        self.out_of_step: str | None = None
        self.check: bool = world.check_collectives
        self.match_cache: dict[tuple[int, int, int], tuple[int, int, frozenset]] = {}
        self.windows: list[weakref.ref] = []
        # Messages from each member count as the member's (its world rank's) traffic.
        for source, peer in enumerate(members):
            self.transport.count_senders(SENDER_SHIFT, sender_prefixes(cid, source), peer)
        world.groups.add(self)

    def __repr__(self) -> str:
        return f"<ucxcomm.comm.group.Group of {self.label}>"

    def endpoint(self, rank: int) -> Link:
        """The :class:`~ucxcomm.transport.base.Link` to communicator rank ``rank``."""
        ep = self.eps[rank]
        if ep is None:
            ep = self.eps[rank] = self.world.endpoint(self.members[rank])
        return ep

    # ---------------------------------------------------------------- checks
    def check_open(self) -> None:
        """Raise :class:`~ucxcomm.ClosedError` once the communicator or world is closed,
        :class:`~ucxcomm.Revoked` once it was revoked."""
        if self.closed or self.world.closed:
            if self.revoked is not None and not self.shut and not self.world.closed:
                raise Revoked(f"{self.label} was revoked: {self.revoked}")
            raise ClosedError(f"{self.label} is closed")

    def check_peer(self, rank: Any, what: str, allow_any: bool = False) -> int:
        """A valid rank of this communicator (``ANY_SOURCE`` too with ``allow_any``)."""
        if type(rank) is not int:
            rank = check_int(rank, what)
        if allow_any and rank == ANY_SOURCE:
            return rank
        if not 0 <= rank < self.size:
            raise ValueError(f"{what} {rank} is out of range for a communicator of size "
                             f"{self.size}")
        return rank

    @staticmethod
    def check_tag(tag: Any, allow_any: bool = False) -> int:
        """A valid user tag (``ANY_TAG`` too with ``allow_any``)."""
        if type(tag) is not int:
            tag = check_int(tag, "tag")
        if allow_any and tag == ANY_TAG:
            return tag
        if not 0 <= tag <= TAG_UB:
            raise ValueError(f"tag {tag} is out of range: user tags are 0 <= tag <= "
                             f"TAG_UB ({TAG_UB})")
        return tag

    def check_recv(self, source: Any, tag: Any) -> tuple[int, int]:
        """The checks of a receive: open, ``source`` and ``tag`` (wildcards allowed)."""
        self.check_open()
        return (self.check_peer(source, "source", allow_any=True),
                self.check_tag(tag, allow_any=True))

    # -------------------------------------------------------------- matching
    def match(self, kind: int, source: int, tag: int) -> tuple[int, int, frozenset]:
        """UCX (tag, mask) and the peers a receive depends on (memoized: receives
        repeat the same few (source, tag) pairs)."""
        key = (kind, source, tag)
        got = self.match_cache.get(key)
        if got is None:
            peers = self.peers_all if source == ANY_SOURCE else self.peer_sets[source]
            got = (make_tag(self.cid, kind, max(source, 0), max(tag, 0)),
                   make_mask(source, tag, kind), peers)
            if len(self.match_cache) < 4096:
                self.match_cache[key] = got
        return got

    @staticmethod
    def status(stag: int, nbytes: int) -> Status:
        """The :class:`~ucxcomm.Status` of a message received with UCX tag ``stag``."""
        source, tag = split_tag(stag)
        return Status(source, tag, nbytes)

    def next_seq(self) -> int:
        """The next collective's sequence number (every rank calls collectives in the
        same order, so they agree). Every collective takes one once its arguments are
        checked, so this is where one on an out-of-step communicator is refused."""
        if self.out_of_step is not None:
            raise UcxCommError(self.out_of_step)
        seq = self._coll_seq
        if seq == TAG_UB:
            self.seq_wraps += 1
        self._coll_seq = (seq + 1) & TAG_UB
        return seq

    @property
    def last_seq(self) -> int:
        """The sequence number the last collective took (for its flight record)."""
        return (self._coll_seq - 1) & TAG_UB

    async def await_recv(self, fut: asyncio.Future) -> Any:
        """Await a receive future; on cancellation withdraw it, or, if it already
        matched a message, wait until that message is fully consumed."""
        transport = self.transport
        try:
            return await transport.complete(fut)
        except asyncio.CancelledError:
            if not transport.cancel(fut):
                await transport.settle(fut)
            raise

    # ------------------------------------------------------- object messages
    # The framing is ucxcomm._serialize's (send_object/recv_object); what is the
    # communicator's is below: the tags (first message on (kind, tag), frames on the
    # frames context with the per-destination sequence number) and pooled frame memory.
    def frame_tag(self, seq: int) -> int:
        """The UCX tag of this rank's payload frames of sequence number ``seq``."""
        return make_tag(self.cid, KIND_FRAMES, self.rank, seq)

    def post_send_obj(self, obj: Any, dest: int, kind: int, tag: int
                      ) -> list[asyncio.Future | None]:
        """Post ``obj`` (pickled; ``TypeError`` before any I/O) to ``dest``; the
        operations' futures (None: done at once)."""
        seq = self.frame_seq[dest]
        futs = send_object(self.endpoint(dest).isend, obj,
                           make_tag(self.cid, kind, self.rank, tag), self.frame_tag, seq)
        if len(futs) > 1:  # framed: its sequence number is spent
            self.frame_seq[dest] = (seq + 1) & TAG_UB
        return futs

    def send_framed(self, message: bytes, frames: list[Any], dest: int, kind: int,
                    tag: int) -> list[asyncio.Future | None]:
        """Post an object encoded by the caller (``encode(obj, self.frame_seq[dest])``):
        its first message, then its payload frames."""
        ep = self.endpoint(dest)
        stag = make_tag(self.cid, kind, self.rank, tag)
        if not frames:
            return [ep.isend(message, stag)]
        seq = self.frame_seq[dest]
        self.frame_seq[dest] = (seq + 1) & TAG_UB
        return send_encoded(ep.isend, message, frames, stag, self.frame_tag(seq))

    def post_recv_obj(self, source: int, kind: int, tag: int, peers: Peers = None,
                      spin: bool = False) -> Posted:
        """Post the receive of an object's first message (see :meth:`finish_recv_obj`);
        ``peers`` overrides the peers it depends on (default: the sender's)."""
        utag, mask, default = self.match(kind, source, tag)
        return self.transport.recv_alloc(utag, mask, default if peers is None else peers,
                                         spin=spin)

    async def finish_recv_obj(self, res: Posted) -> tuple[Any, Status]:
        """The object and :class:`~ucxcomm.Status` of a receive posted by
        :meth:`post_recv_obj` (its payload frames received too)."""
        if not isinstance(res, tuple):
            res = await self.await_recv(res)
        stag, nbytes, data = res
        source, tag = split_tag(stag)
        obj = loads_inline(data)  # (the small-object path: no further frame)
        if obj is FRAMED:
            obj, framed = await recv_object(data, functools.partial(self.recv_frames,
                                                                    source))
            nbytes += framed
        return obj, Status(source, tag, nbytes)

    async def recv_frames(self, source: int, header: Header) -> list[Any]:
        """Receive the payload frames announced by ``header`` straight into pooled memory
        (allocated at the announced sizes, all receives posted at once: ranks of a job
        are trusted peers)."""
        ftag = make_tag(self.cid, KIND_FRAMES, source, header.seq)
        peers = self.peer_sets[source]
        transport = self.transport
        buffers = [self.world.pool.take(n) for n in header.sizes]
        futs = [transport.tag_recv(transport.recv_ptr(b), ftag, FULL_MASK, peers)
                for b in buffers]
        pending = [f for f in futs if f is not None]
        if pending:
            transport.wake()
            try:
                if len(pending) == 1:
                    await transport.complete(pending[0])
                else:
                    await asyncio.gather(*pending)
            except asyncio.CancelledError:
                # The header is consumed: take the payload too, so nothing is left half read.
                for f in pending:
                    await transport.settle(f)
                raise
        return buffers

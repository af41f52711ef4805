"""``Comm``: ranks, point-to-point (objects and buffers), split/dup and barrier.

MPI semantics on top of :mod:`ucxcomm.transport`; this module never touches UCX.
Lowercase methods move Python objects (pickle protocol 5, array payloads out of band),
Capitalized methods move raw buffers straight from/into the caller's memory.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from .._serialize import FRAMED, Header, decode_header, encode, loads, loads_inline
from ..errors import ClosedError, CommTimeoutError, PeerFailure, TruncationError
from ..transport.base import Link, Transport
from .algorithms import ScratchPool
from .collectives import Collectives
from .pool import FramePool
from .request import Request, Status
from .tags import (
    ANY_SOURCE,
    ANY_TAG,
    KIND_COLL,
    KIND_FRAMES,
    KIND_P2P,
    MAX_CID,
    TAG_UB,
    make_mask,
    make_tag,
    split_tag,
)

__all__ = ["Comm", "World"]

log = logging.getLogger(__name__)

_FULL = (1 << 64) - 1


class World:
    """Per-process state every communicator shares: worker, peer addresses, endpoints.

    Created by :func:`ucxcomm.init`; users never build one.
    """

    def __init__(self, worker: Transport, rank: int, size: int,
                 addresses: list[bytes]) -> None:
        self.worker = worker
        self.rank = rank
        self.size = size
        self.addresses = addresses
        self.next_cid = 1  # 0 is the world communicator
        self._eps: dict[int, Link] = {}
        self.closed = False
        self.closers: list[Callable[[], Awaitable[None]]] = []
        self.pool = FramePool()
        self.scratch = ScratchPool()
        self.comm = Comm(self, tuple(range(size)), 0)

    def endpoint(self, world_rank: int) -> Link:
        ep = self._eps.get(world_rank)
        if ep is None:
            ep = self.worker.connect(self.addresses[world_rank], peer=world_rank)
            self._eps[world_rank] = ep
        return ep

    def peer_failed(self, world_rank: int) -> None:
        """Called when the bootstrap store reports that ``world_rank`` died."""
        if world_rank == self.rank or self.closed:
            return
        log.warning("rank %d: peer rank %d died or left without closing", self.rank,
                    world_rank)
        self.worker.fail_peer(world_rank, PeerFailure(
            f"rank {world_rank} died or left the job without closing", peer=world_rank))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
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
        self.worker.abort()


def _check_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


async def _with_timeout(aw: Awaitable[Any], timeout: float | None, what: str) -> Any:
    if timeout is None:
        return await aw
    try:
        async with asyncio.timeout(timeout):
            return await aw
    except TimeoutError:
        raise CommTimeoutError(f"{what} did not complete within {timeout:g} s") from None


class Comm(Collectives):
    """A communicator: a group of ranks with its own message space.

    Point-to-point methods are defined here, collectives in
    :mod:`ucxcomm.comm.collectives`.

    Obtain the world with ``await ucxcomm.init()``; derive others with :meth:`split`
    and :meth:`dup`. Attributes ``rank`` and ``size`` are this process's rank in the
    communicator and the number of ranks.
    """

    def __init__(self, world: World, group: tuple[int, ...], cid: int) -> None:
        if cid > MAX_CID:
            raise RuntimeError(f"too many communicators (context id {cid} > {MAX_CID})")
        self._world = world
        self._worker = world.worker
        self._group = group
        self._cid = cid
        self.rank = group.index(world.rank)
        self.size = len(group)
        self._peers_all = frozenset(group)
        self._peer_sets = [frozenset((g,)) for g in group]
        self._eps: list[Any] = [None] * self.size
        self._match_cache: dict[tuple[int, int, int], tuple[int, int, frozenset]] = {}
        self._p2p_base = make_tag(cid, KIND_P2P, self.rank, 0)
        self._frame_seq = [0] * self.size
        self._coll_seq = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<ucxcomm.Comm cid={self._cid} rank={self.rank} size={self.size}>"

    # ---------------------------------------------------------------- checks
    def _check_open(self) -> None:
        if self._closed or self._world.closed:
            raise ClosedError(f"{self!r} is closed")

    def _check_peer(self, rank: Any, what: str, allow_any: bool = False) -> int:
        if type(rank) is not int:
            rank = _check_int(rank, what)
        if allow_any and rank == ANY_SOURCE:
            return rank
        if not 0 <= rank < self.size:
            raise ValueError(f"{what} {rank} is out of range for a communicator of size "
                             f"{self.size}")
        return rank

    @staticmethod
    def _check_tag(tag: Any, allow_any: bool = False) -> int:
        if type(tag) is not int:
            tag = _check_int(tag, "tag")
        if allow_any and tag == ANY_TAG:
            return tag
        if not 0 <= tag <= TAG_UB:
            raise ValueError(f"tag {tag} is out of range: user tags are 0 <= tag <= "
                             f"TAG_UB ({TAG_UB})")
        return tag

    def _ep(self, dest: int) -> Any:
        ep = self._eps[dest]
        if ep is None:
            ep = self._eps[dest] = self._world.endpoint(self._group[dest])
        return ep

    def _check_recv(self, source: Any, tag: Any) -> tuple[int, int]:
        self._check_open()
        return (self._check_peer(source, "source", allow_any=True),
                self._check_tag(tag, allow_any=True))

    def _match(self, kind: int, source: int, tag: int) -> tuple[int, int, frozenset]:
        """UCX (tag, mask) and the peers a receive depends on (memoized: receives
        repeat the same few (source, tag) pairs)."""
        key = (kind, source, tag)
        got = self._match_cache.get(key)
        if got is None:
            peers = self._peers_all if source == ANY_SOURCE else self._peer_sets[source]
            got = (make_tag(self._cid, kind, max(source, 0), max(tag, 0)),
                   make_mask(source, tag), peers)
            if len(self._match_cache) < 4096:
                self._match_cache[key] = got
        return got

    def _status(self, stag: int, nbytes: int) -> Status:
        source, tag = split_tag(stag)
        return Status(source, tag, nbytes)

    async def _await_recv(self, fut: asyncio.Future) -> Any:
        """Await a receive future; on cancellation withdraw it, or, if it already
        matched a message, wait until that message is fully consumed."""
        try:
            return await self._worker.complete(fut)
        except asyncio.CancelledError:
            if not self._worker.cancel(fut):
                await self._worker.settle(fut)
            raise

    # ------------------------------------------------------- buffer messages
    def _post_send(self, buf: Any, dest: Any, tag: Any) -> Any:
        if self._closed or self._world.closed:
            raise ClosedError(f"{self!r} is closed")
        if type(dest) is not int or not 0 <= dest < self.size:
            dest = self._check_peer(dest, "dest")
        if type(tag) is not int or not 0 <= tag <= TAG_UB:
            tag = self._check_tag(tag)
        return self._ep(dest).isend(buf, self._p2p_base | tag)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` to ``dest``; returns a :class:`Request`.

        Raises
        ------
        ValueError, TypeError
            Bad buffer, rank or tag (before anything is sent).
        ClosedError, PeerFailure
        """
        fut = self._post_send(buf, dest, tag)
        if fut is None:
            return Request.completed()
        self._worker.wake()
        return Request(fut)

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
        fut = self._post_send(buf, dest, tag)
        if fut is not None:
            if timeout is None:
                await self._worker.complete(fut)
            else:
                await _with_timeout(self._worker.complete(fut), timeout, "Send")

    def _post_recv(self, buf: Any, source: Any, tag: Any, kind: int = KIND_P2P,
                   spin: bool = False) -> Any:
        target = self._worker.recv_ptr(buf)  # validates the buffer first
        if (self._closed or type(source) is not int or type(tag) is not int
                or not -1 <= source < self.size or not -1 <= tag <= TAG_UB):
            source, tag = self._check_recv(source, tag)  # raises, or normalizes
        elif self._world.closed:
            raise ClosedError(f"{self!r} is closed")
        return self._worker.recv_into(target, *self._match(kind, source, tag), spin=spin)

    def _recv_status(self, result: tuple[int, int, int]) -> Status:
        stag, nbytes, cap = result
        status = self._status(stag, nbytes)
        if nbytes > cap:
            raise TruncationError(
                f"message of {nbytes} bytes from rank {status.source} (tag {status.tag}) "
                f"truncated to the {cap}-byte receive buffer",
                nbytes=nbytes, capacity=cap, status=status)
        return status

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
        res = self._post_recv(buf, source, tag, spin=True)
        if type(res) is not tuple:
            if timeout is None:
                res = await self._await_recv(res)
            else:
                res = await _with_timeout(self._await_recv(res), timeout, "Recv")
        return self._recv_status(res)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Start receiving into ``buf``; awaiting the request gives a :class:`Status`.

        ``req.cancel()`` withdraws it if no message matched yet.
        """
        target = self._worker.recv_ptr(buf)  # validates the buffer first
        source, tag = self._check_recv(source, tag)
        worker = self._worker
        res = worker.recv_into(target, *self._match(KIND_P2P, source, tag),
                               finish=self._recv_status)
        if type(res) is tuple:
            try:
                return Request.completed(self._recv_status(res))
            except TruncationError as exc:
                return Request.failed(exc)
        worker.wake()
        return Request(res, lambda: worker.cancel(res), lambda: worker.settle(res))

    # ------------------------------------------------------- object messages
    def _post_send_obj(self, obj: Any, dest: int, kind: int, tag: int) -> list[Any]:
        message, frames = encode(obj, self._frame_seq[dest])  # TypeError before any I/O
        return self._send_framed(message, frames, dest, kind, tag)

    def _send_framed(self, message: bytes, frames: list[Any], dest: int, kind: int,
                     tag: int) -> list[Any]:
        """Post an encoded object: its first message, then its payload frames."""
        ep = self._ep(dest)
        futs = [ep.isend(message, make_tag(self._cid, kind, self.rank, tag))]
        if frames:
            seq = self._frame_seq[dest]
            self._frame_seq[dest] = (seq + 1) & TAG_UB
            ftag = make_tag(self._cid, KIND_FRAMES, self.rank, seq)
            futs.extend(ep.isend(f, ftag) for f in frames)
        return futs

    def _post_recv_obj(self, source: int, kind: int, tag: int, spin: bool = False) -> Any:
        return self._worker.recv_alloc(*self._match(kind, source, tag), spin=spin)

    async def _finish_recv_obj(self, res: Any) -> tuple[Any, Status]:
        if type(res) is not tuple:
            res = await self._await_recv(res)
        stag, nbytes, data = res
        source, tag = split_tag(stag)
        obj = loads_inline(data)
        if obj is not FRAMED:
            return obj, Status(source, tag, nbytes)
        header = decode_header(data)
        buffers = await self._recv_frames(source, header)
        return loads(header, buffers), Status(source, tag, nbytes + sum(header.sizes))

    async def _recv_frames(self, source: int, header: Header) -> list[Any]:
        """Receive the payload frames announced by ``header`` straight into pooled memory."""
        ftag = make_tag(self._cid, KIND_FRAMES, source, header.seq)
        peers = self._peer_sets[source]
        worker = self._worker
        buffers = [self._world.pool.take(n) for n in header.sizes]
        futs = [worker.tag_recv(worker.recv_ptr(b), ftag, _FULL, peers) for b in buffers]
        pending = [f for f in futs if f is not None]
        if pending:
            worker.wake()
            try:
                if len(pending) == 1:
                    await worker.complete(pending[0])
                else:
                    await asyncio.gather(*pending)
            except asyncio.CancelledError:
                # The header is consumed: take the payload too, so nothing is left half read.
                for f in pending:
                    await worker.settle(f)
                raise
        return buffers

    async def send(self, obj: Any, dest: int, tag: int = 0, *,
                   timeout: float | None = None) -> None:
        """Send a picklable object (array payloads go out of band, without copies).

        Raises
        ------
        ValueError, TypeError
            Bad rank or tag, or ``obj`` cannot be pickled (before anything is sent).
        ClosedError, PeerFailure, CommTimeoutError
        """
        self._check_open()
        if type(dest) is not int or not 0 <= dest < self.size:
            dest = self._check_peer(dest, "dest")
        if type(tag) is not int or not 0 <= tag <= TAG_UB:
            tag = self._check_tag(tag)
        message, frames = encode(obj, self._frame_seq[dest])  # TypeError before any I/O
        if not frames:  # fast path: one message
            fut = self._ep(dest).isend(message, self._p2p_base | tag)
            if fut is None:
                return
            futs = [fut]
        else:
            futs = [f for f in self._send_framed(message, frames, dest, KIND_P2P, tag)
                    if f is not None]
            if not futs:
                return
        if len(futs) == 1:
            if timeout is None:
                await self._worker.complete(futs[0])
            else:
                await _with_timeout(self._worker.complete(futs[0]), timeout, "send")
        else:
            self._worker.wake()
            await _with_timeout(asyncio.gather(*futs), timeout, "send")

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        """Start sending an object; returns a :class:`Request`."""
        self._check_open()
        dest = self._check_peer(dest, "dest")
        tag = self._check_tag(tag)
        futs = [f for f in self._post_send_obj(obj, dest, KIND_P2P, tag) if f is not None]
        if not futs:
            return Request.completed()
        self._worker.wake()
        return Request(futs[0] if len(futs) == 1 else asyncio.gather(*futs))

    async def recv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *,
                   return_status: bool = False, timeout: float | None = None) -> Any:
        """Receive an object; with ``return_status=True`` returns ``(obj, status)``.

        Raises
        ------
        ClosedError, PeerFailure, CommTimeoutError
        """
        source, tag = self._check_recv(source, tag)
        res = self._post_recv_obj(source, KIND_P2P, tag, spin=True)
        if type(res) is tuple:  # fast path: a small object that was already here
            obj = loads_inline(res[2])
            if obj is not FRAMED:
                if return_status:
                    src, utag = split_tag(res[0])
                    return obj, Status(src, utag, res[1])
                return obj
        if timeout is None:
            obj, status = await self._finish_recv_obj(res)
        else:
            obj, status = await _with_timeout(self._finish_recv_obj(res), timeout, "recv")
        return (obj, status) if return_status else obj

    def irecv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Start receiving an object; awaiting the request gives the object.

        ``req.cancel()`` withdraws it if no message matched yet.
        """
        source, tag = self._check_recv(source, tag)
        res = self._post_recv_obj(source, KIND_P2P, tag)
        self._worker.wake()
        task = asyncio.ensure_future(self._irecv_obj(res))
        if type(res) is tuple:
            return Request(task)
        # The task itself withdraws or settles the receive when cancelled.
        return Request(task, lambda: self._worker.cancel(res))

    async def _irecv_obj(self, res: Any) -> Any:
        return (await self._finish_recv_obj(res))[0]

    async def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0,
                       source: int = ANY_SOURCE, recvtag: int = ANY_TAG, *,
                       return_status: bool = False, timeout: float | None = None) -> Any:
        """Send ``sendobj`` to ``dest`` and receive one object, without deadlock."""
        self._check_open()
        dest = self._check_peer(dest, "dest")
        sendtag = self._check_tag(sendtag)
        source, recvtag = self._check_recv(source, recvtag)
        futs = [f for f in self._post_send_obj(sendobj, dest, KIND_P2P, sendtag)
                if f is not None]
        rres = self._post_recv_obj(source, KIND_P2P, recvtag)
        self._worker.wake()

        async def both() -> tuple[Any, Status]:
            got = await self._finish_recv_obj(rres)
            if futs:
                await asyncio.gather(*futs)
            return got

        obj, status = await _with_timeout(both(), timeout, "sendrecv")
        return (obj, status) if return_status else obj

    async def Sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int = ANY_SOURCE,
                       sendtag: int = 0, recvtag: int = ANY_TAG, *,
                       timeout: float | None = None) -> Status:
        """Buffer form of :meth:`sendrecv`; returns the receive's :class:`Status`."""
        rtarget = self._worker.recv_ptr(recvbuf)
        source, recvtag = self._check_recv(source, recvtag)
        sfut = self._post_send(sendbuf, dest, sendtag)
        rres = self._worker.recv_into(rtarget, *self._match(KIND_P2P, source, recvtag))
        self._worker.wake()

        async def both() -> Status:
            res = rres if type(rres) is tuple else await self._await_recv(rres)
            if sfut is not None:
                await sfut
            return self._recv_status(res)

        return await _with_timeout(both(), timeout, "Sendrecv")

    # ------------------------------------------------------------------ probe
    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        """The :class:`Status` of a matching message that is ready, else None (no wait)."""
        source, tag = self._check_recv(source, tag)
        utag, mask, _ = self._match(KIND_P2P, source, tag)
        got = self._worker.probe(utag, mask)
        return None if got is None else self._status(*got)

    async def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *,
                    timeout: float | None = None) -> Status:
        """Wait until a matching message is ready; returns its :class:`Status`.

        The message is not received. For objects, ``nbytes`` is the size of the first
        part (header and in-band pickle) only.
        """
        source, tag = self._check_recv(source, tag)
        fut = self._worker.probe_wait(*self._match(KIND_P2P, source, tag))
        got = await _with_timeout(self._await_recv(fut), timeout, "probe")
        return self._status(*got)

    # ------------------------------------------------------ internal traffic
    def _next_coll_tag(self) -> int:
        seq = self._coll_seq
        self._coll_seq = (seq + 1) & TAG_UB
        return seq

    async def _allgather_obj(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (internal; small objects, small worlds)."""
        seq = self._next_coll_tag()
        out: list[Any] = [None] * self.size
        out[self.rank] = obj
        futs: list[Any] = []
        for r in range(self.size):
            if r != self.rank:
                futs.extend(f for f in self._post_send_obj(obj, r, KIND_COLL, seq)
                            if f is not None)
        rfuts = {r: self._post_recv_obj(r, KIND_COLL, seq) for r in range(self.size)
                 if r != self.rank}
        self._worker.wake()
        for r, fut in rfuts.items():
            out[r] = (await self._finish_recv_obj(fut))[0]
        if futs:
            await asyncio.gather(*futs)
        return out

    async def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank of the communicator has entered the barrier.

        Dissemination algorithm: ceil(log2(size)) rounds of zero-byte messages.
        """
        self._check_open()
        await _with_timeout(self._barrier(), timeout, "barrier")

    def _barrier(self) -> Awaitable[None]:
        # The sequence number is taken now, in call order (ibarrier runs it later).
        return self._run_barrier(self._next_coll_tag())

    async def _run_barrier(self, seq: int) -> None:
        stag = make_tag(self._cid, KIND_COLL, self.rank, seq)
        worker = self._worker
        dist = 1
        while dist < self.size:
            dest = (self.rank + dist) % self.size
            src = (self.rank - dist) % self.size
            sfut = self._ep(dest).isend(b"", stag)
            utag, mask, _ = self._match(KIND_COLL, src, seq)
            res = worker.recv_into(worker.recv_ptr(bytearray(0)), utag, mask,
                                   self._peers_all)  # any member's death fails it
            if type(res) is not tuple:
                await self._await_recv(res)
            if sfut is not None:
                await worker.complete(sfut)
            dist *= 2

    # ----------------------------------------------------------- communicators
    async def split(self, color: int | None, key: int = 0) -> Comm | None:
        """Partition the ranks by ``color``; order each part by ``(key, rank)``.

        Collective. Ranks passing ``color=None`` get None. The new communicators never
        match messages of this one, nor of each other.

        Raises
        ------
        ValueError, TypeError
            ``color`` is negative or not an int/None; ``key`` is not an int.
        """
        self._check_open()
        if color is not None:
            color = _check_int(color, "color")
            if color < 0:
                raise ValueError(f"color must be >= 0 or None, got {color}")
        key = _check_int(key, "key")
        world = self._world
        infos = await self._allgather_obj((color, key, world.next_cid))
        cid = max(info[2] for info in infos)
        world.next_cid = cid + 1
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k, _) in enumerate(infos) if c == color)
        return Comm(world, tuple(self._group[r] for _, r in members), cid)

    async def dup(self) -> Comm:
        """A communicator with the same ranks and a separate message space (collective)."""
        sub = await self.split(0, self.rank)
        assert sub is not None
        return sub

    # --------------------------------------------------------------- info/close
    def transport_info(self) -> dict[int, list[tuple[str, str]]]:
        """The UCX (transport, device) lanes to each peer rank of this communicator."""
        self._check_open()
        return {r: self._ep(r).transports() for r in range(self.size)}

    @property
    def closed(self) -> bool:
        return self._closed or self._world.closed

    async def close(self, *, timeout: float | None = 60.0) -> None:
        """Collective: wait for every rank, then release. Closing the world communicator
        finalizes ucxcomm in this process. Idempotent.
        """
        if self.closed:
            return
        try:
            await self.barrier(timeout=timeout)
        except (PeerFailure, CommTimeoutError) as exc:
            log.warning("close: not every rank reached close (%s); closing anyway", exc)
        finally:
            self._closed = True
            if self._cid == 0:
                await self._world.close()

    def abort(self) -> None:
        """Close at once, without waiting for other ranks (safe in ``finally``)."""
        self._closed = True
        if self._cid == 0:
            self._world.abort()

    async def __aenter__(self) -> Comm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is None:
            await self.close()
        else:
            self.abort()

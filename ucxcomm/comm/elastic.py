"""Elastic membership: revoke, agree, shrink, failure events (docs/elastic.md).

The bootstrap store is the failure detector (a rank is dead when its store connection
drops: ``launch/store.py``) and the coordinator of the decisions these verbs need:
``agree`` and ``shrink`` are each one ``decide`` request, answered the same to every
member once each member has either taken part or is gone. A revocation is a notice the
store relays to the communicator's members; each revokes its copy locally: every
pending operation on the communicator's tags fails with :class:`~ucxcomm.Revoked`,
and every later one raises it.

This module reaches the store only through the world's ``store`` attribute (a
``StoreClient``, set by the bootstrap), the transport only through its declared
interface (``revoke_tags``).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._deadline import check_timeout
from ..errors import BootstrapError, ClosedError, PeerFailure, Revoked
from ..tags import MAX_CID, context_of

if TYPE_CHECKING:
    from .communicator import Comm, World
    from .group import Group

__all__ = ["PeerFailed", "PeerJoined", "agree", "events", "notice_received", "revoke",
           "shrink"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerFailed:
    """A member of the communicator died (``rank``: its rank there; ``reason``)."""

    rank: int
    reason: str


@dataclass(frozen=True)
class PeerJoined:
    """A process joined the communicator's membership as ``rank`` (``Comm.grow``)."""

    rank: int


def digest(members: tuple[int, ...]) -> str:
    """A short name of a membership: sibling communicators of a ``split`` share their
    context id, never their members."""
    return f"{zlib.crc32(repr(members).encode()):08x}{len(members):x}"


def _check_usable(comm: Comm, what: str) -> Group:
    g = comm._group
    if g.shut or g.world.closed:
        raise ClosedError(f"{what}: {g.label} is closed")
    return g


# ------------------------------------------------------------------------ revoke
def revoke(comm: Comm) -> None:
    """``Comm.revoke``: revoke locally, then tell the other members (through the store;
    returns at once)."""
    g = _check_usable(comm, "revoke")
    if g.revoked is not None:
        return
    world = g.world
    revoke_local(g, f"revoked by rank {g.rank}")
    store = world.store
    if store is not None:
        others = [m for m in g.members if m != world.rank and m not in world.dead]
        if others:
            store.notify(others, f"revoke {g.cid} {digest(g.members)}")


def revoke_local(g: Group, why: str) -> None:
    """Revoke this process's copy of ``g``: its pending operations fail with
    :class:`~ucxcomm.Revoked`, later ones raise it, its ``events()`` end."""
    if g.revoked is not None or g.shut:
        return
    g.revoked = why
    g.closed = True  # (the hot paths' one flag: they fall back to check_open)
    message = f"{g.label} was revoked: {why}"
    value, mask = context_of(g.cid)
    g.transport.revoke_tags(value, mask, lambda: Revoked(message))
    log.info("%s", message)


def notice_received(world: World, sender: int, value: str) -> None:
    """A notice the store relayed from world rank ``sender``: a revocation of one of
    this process's communicators of which ``sender`` is a member (anything else is
    ignored)."""
    parts = value.split(" ")
    if len(parts) != 3 or parts[0] != "revoke" or not parts[1].isdigit():
        log.debug("ignored a notice from rank %d: %.60r", sender, value)
        return
    cid = int(parts[1])
    for g in list(world.groups):
        if g.cid == cid and sender in g.members and digest(g.members) == parts[2]:
            revoke_local(g, f"revoked by rank {g.members.index(sender)}")


# ------------------------------------------------------------------ agree/shrink
async def _decide(g: Group, what: str, value: str, timeout: float | None
                  ) -> tuple[dict[int, str], frozenset[int]]:
    """One decision among ``g``'s members: ``({world rank: value} of the members alive
    when it was taken, {world ranks gone})``, the same on every member."""
    world = g.world
    n = g.ft_seq
    g.ft_seq += 1
    if world.store is None:  # a world of one process: nobody else to decide with
        return {world.rank: value}, frozenset()
    key = f"{what}/{g.cid}/{digest(g.members)}/{n}"
    try:
        values, gone = await world.store.decide(key, list(g.members), value, timeout)
    except BootstrapError as exc:
        raise PeerFailure(f"{what}: the bootstrap store, which coordinates it, is gone "
                          f"({exc})") from None
    dead = frozenset(gone)
    members = set(g.members)
    if not dead <= members or not values.keys() <= members - dead:
        raise PeerFailure(f"{what}: the bootstrap store answered for other ranks")
    for r in sorted(dead):
        world.peer_failed(r, quiet=True)
    return values, dead


async def agree(comm: Comm, flag: Any = True, timeout: float | None = None
                ) -> tuple[bool, frozenset[int]]:
    """``Comm.agree``: the AND of the live members' flags, and the members gone."""
    if type(flag) is not bool:
        raise TypeError(f"agree: flag must be a bool, got {type(flag).__name__}")
    check_timeout(timeout, "agree")
    g = _check_usable(comm, "agree")
    values, dead = await _decide(g, "agree", "1" if flag else "0", timeout)
    return (all(v == "1" for v in values.values()),
            frozenset(g.members.index(r) for r in dead))


async def shrink(comm: Comm, timeout: float | None = None) -> Comm:
    """``Comm.shrink``: a communicator of the survivors, in their old rank order."""
    from .communicator import Comm

    check_timeout(timeout, "shrink")
    g = _check_usable(comm, "shrink")
    world = g.world
    values, dead = await _decide(g, "shrink", str(world.next_cid), timeout)
    try:
        cid = max(int(v) for v in values.values())
    except ValueError:
        raise PeerFailure("shrink: a member proposed no context id") from None
    if not 0 < cid <= MAX_CID:
        raise PeerFailure(f"shrink: context id {cid} is out of range")
    world.next_cid = max(world.next_cid, cid + 1)
    return Comm(world, tuple(m for m in g.members if m not in dead), cid)


# ------------------------------------------------------------------------ events
class _Events:
    """``Comm.events()``: failures (and joins) as they happen; ends when the
    communicator is closed (a revoked one still reports)."""

    def __init__(self, g: Group) -> None:
        self._g = g
        self._queue: asyncio.Queue = asyncio.Queue()
        world = g.world
        for r, m in enumerate(g.members):  # what is known already comes first
            if m in world.dead:
                self._queue.put_nowait(PeerFailed(r, world.dead_reason.get(m, "died")))
        g.listeners.append(self._queue)

    def __aiter__(self) -> AsyncIterator[PeerFailed | PeerJoined]:
        return self

    async def __anext__(self) -> PeerFailed | PeerJoined:
        if self._queue.empty() and (self._g.shut or self._g.world.closed):
            self._detach()
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None:
            self._detach()
            raise StopAsyncIteration
        return event

    def _detach(self) -> None:
        if self._queue in self._g.listeners:
            self._g.listeners.remove(self._queue)


def events(comm: Comm) -> _Events:
    return _Events(_check_usable(comm, "events"))


def publish(world: World, world_rank: int, reason: str) -> None:
    """Tell the ``events()`` of every communicator with ``world_rank`` that it died."""
    for g in list(world.groups):
        if world_rank in g.members:
            for q in list(g.listeners):
                q.put_nowait(PeerFailed(g.members.index(world_rank), reason))


def end_events(g: Group) -> None:
    """The communicator was closed: its ``events()`` iterators end."""
    for q in g.listeners:
        q.put_nowait(None)
    g.listeners.clear()

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
import base64
import json
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._deadline import Deadline, check_timeout
from ..errors import BootstrapError, ClosedError, PeerFailure, Revoked
from ..tags import MAX_CID, MAX_RANKS, context_of

if TYPE_CHECKING:
    from .communicator import Comm, World
    from .group import Group

__all__ = ["PeerFailed", "PeerJoined", "admission", "agree", "events", "grow",
           "notice_received", "revoke", "shrink", "take_joiners"]

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
        values, gone = await world.store.decide(key, list(g.members), value, timeout,
                                                lives=list(g.lives))
    except BootstrapError as exc:
        raise PeerFailure(f"{what}: the bootstrap store, which coordinates it, is gone "
                          f"or refused to decide ({exc})") from None
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
    new = Comm(world, tuple(m for m in g.members if m not in dead), cid)
    new._group.origin_size = g.origin_size
    return new


# ------------------------------------------------------------------------ grow
#: What a process waiting to join writes to the store (``launch/bootstrap.py``): the
#: ``n``-th joiner's entry is key ``joiner/<n>`` (``n`` from the counter ``joiners``), a
#: JSON object ``{"rank", "life", "address", "host"}`` (the last two base64); its
#: admission, key ``admit/<rank>/<life>``, the JSON object :func:`grow` writes.
JOINER_KEY = "joiner/{}"
ADMIT_KEY = "admit/{}/{}"
#: The longest joiner entry or admission record read (a worker address is ~1 KiB; an
#: admission carries every member's).
MAX_JOINER_ENTRY = 16 << 10


def _joiner(raw: bytes) -> tuple[int, int, bytes, bytes] | None:
    """``(rank, life, address, host)`` of a joiner's entry, None when malformed."""
    if len(raw) > MAX_JOINER_ENTRY:
        return None
    try:
        entry = json.loads(raw)
        rank, life = entry["rank"], entry["life"]
        address = base64.b64decode(entry["address"], validate=True)
        host = base64.b64decode(entry["host"], validate=True)
    except (ValueError, KeyError, TypeError):
        return None
    if type(rank) is not int or type(life) is not int or not 0 <= rank < MAX_RANKS \
            or life < 2 or not address:
        return None
    return rank, life, address, host


async def take_joiners(slots: dict[int, int], target: int, cursor: int,
                       fetch: Callable[[int], Awaitable[bytes]]
                       ) -> tuple[dict[int, tuple[int, bytes, bytes]], int]:
    """Fill ``slots`` (rank -> life of the live members; updated in place) with joiners
    until it has ``target`` ranks: entries ``fetch(cursor)``, ``fetch(cursor + 1)``...
    in the order they registered. A joiner of a rank whose member has an older life
    replaces that member (the store lets a rank join again only once its previous
    process is gone: the member died after the decision); one of an older or the same
    life, or a malformed entry, is passed over. Returns ``({rank: (life, address,
    host)} admitted, the next cursor)``: a function of the entries only, so every member
    reading the same ones admits the same joiners."""
    joiners: dict[int, tuple[int, bytes, bytes]] = {}
    while len(slots) < target:
        entry = _joiner(await fetch(cursor))
        cursor += 1
        if entry is not None and entry[1] > slots.get(entry[0], 0):
            slots[entry[0]] = entry[1]
            joiners[entry[0]] = entry[1:]
    return joiners, cursor


async def grow(comm: Comm, size: Any = None, timeout: float | None = None) -> Comm:
    """``Comm.grow``: the live members and enough joiners to make ``size``."""
    from .communicator import Comm

    if size is not None and (type(size) is not int):
        raise TypeError(f"grow: size must be an int, got {type(size).__name__}")
    check_timeout(timeout, "grow")
    g = _check_usable(comm, "grow")
    world = g.world
    live_now = [m for m in g.members if m not in world.dead]
    target = g.origin_size if size is None else size
    if target < len(live_now) or target > MAX_RANKS:
        raise ValueError(f"grow: size {target} is below the {len(live_now)} live members"
                         if target < len(live_now) else f"grow: size {target} is too large")
    deadline = Deadline(timeout, "grow")
    values, dead = await _decide(g, "grow", f"{world.next_cid} {world.joined_cursor}",
                                 deadline.left())
    try:
        cid = max(int(v.split()[0]) for v in values.values())
        cursor = max(int(v.split()[1]) for v in values.values())
    except (ValueError, IndexError):
        raise PeerFailure("grow: a member sent a malformed proposal") from None
    if not 0 < cid <= MAX_CID or cursor < 0:
        raise PeerFailure(f"grow: context id {cid} or joiner {cursor} is out of range")
    slots = {m: g.lives[i] for i, m in enumerate(g.members) if m not in dead}
    store = world.store
    if store is None and len(slots) < target:
        raise PeerFailure("grow: no bootstrap store to admit joiners through")

    async def fetch(n: int) -> bytes:
        assert store is not None
        return await store.get(JOINER_KEY.format(n), deadline.left())

    joiners, cursor = await take_joiners(slots, target, cursor, fetch)
    world.joined_cursor = cursor
    world.next_cid = max(world.next_cid, cid + 1)
    for rank, (life, address, host) in joiners.items():
        world.admit(rank, address, host, life)
    members = tuple(sorted(slots))
    hosts = world.hosts
    record = json.dumps({
        "cid": cid, "members": list(members), "cursor": cursor,
        "check": world.check_collectives,
        "lives": {str(m): world.lives.get(m, 1) for m in members},
        "addresses": {str(m): base64.b64encode(world.addresses[m]).decode() for m in members},
        "hosts": {str(m): base64.b64encode(hosts[m] if hosts else b"").decode()
                  for m in members}}).encode()
    assert store is not None or not joiners
    for rank, (life, _, _) in joiners.items():  # (every member writes the same record)
        await store.set(ADMIT_KEY.format(rank, life), record, deadline.left())
    new = Comm(world, members, cid)
    new._group.origin_size = target
    for rank in joiners:
        for q in list(g.listeners):
            q.put_nowait(PeerJoined(members.index(rank)))
    return new


def admission(raw: bytes) -> dict[str, Any]:
    """The admission record :func:`grow` wrote, checked (``ValueError`` otherwise):
    ``cid``, ``members`` (world ranks), ``lives``, ``addresses`` and ``hosts`` by world
    rank, ``cursor``, ``check``."""
    if len(raw) > MAX_JOINER_ENTRY * 64:
        raise ValueError("the admission record is too large")
    rec = json.loads(raw)
    members = rec["members"]
    if (type(rec["cid"]) is not int or not 0 < rec["cid"] <= MAX_CID
            or not isinstance(members, list) or not members
            or not all(type(m) is int and 0 <= m < MAX_RANKS for m in members)
            or len(set(members)) != len(members) or type(rec["cursor"]) is not int
            or type(rec["check"]) is not bool):
        raise ValueError("a malformed admission record")
    lives: dict[int, int] = {}
    addresses: dict[int, bytes] = {}
    hosts: dict[int, bytes] = {}
    for m in members:
        life = rec["lives"][str(m)]
        if type(life) is not int or life < 1:
            raise ValueError("a malformed admission record")
        lives[m] = life
        addresses[m] = base64.b64decode(rec["addresses"][str(m)], validate=True)
        hosts[m] = base64.b64decode(rec["hosts"][str(m)], validate=True)
    return {"cid": rec["cid"], "members": tuple(members), "cursor": rec["cursor"],
            "check": rec["check"], "lives": lives, "addresses": addresses, "hosts": hosts}


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

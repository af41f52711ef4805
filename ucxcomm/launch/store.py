"""A small token-protected TCP key-value store for forming the world (asyncio streams).

Wire format: each frame is a 4-byte big-endian length followed by a JSON object. The
first frame a client sends must be ``{"op": "auth", "token": ...}``; a client with the
wrong token (or none) is answered with an error and disconnected before it can read
or write any key. Values are bytes (base64 on the wire).

Beyond ``set``/``get`` (``get`` waits until the key exists) and ``add`` (a counter), a
client may ``join`` as a rank: its connection then doubles as a liveness watch. If it
drops without ``leave``, every other client receives ``{"event": "dead", "rank": r}``.
This is how ranks learn that a peer died without giving up UCX shared memory (UCX
peer error handling would pin endpoints to TCP).

Two more requests serve elastic membership (docs/elastic.md), from joined ranks only:
``notify`` relays a short value to the listed joined ranks (``{"event": "notice"}``:
how a communicator's revocation reaches its members), and ``decide`` is a decision
among a set of ranks that this server coordinates: every member sends its value under
the same key; once each member has either sent one or dropped (died or left), every
member that sent one gets the same answer: the values of the members still alive and
the members gone. The store is the failure detector (a rank is dead when its
connection drops), so the decision ends whatever the timing of deaths.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import struct
from collections.abc import Callable
from typing import Any

from .._deadline import Deadline, within
from .._net import watch_liveness
from ..errors import BootstrapError, CommTimeoutError

__all__ = ["StoreClient", "StoreServer"]

log = logging.getLogger(__name__)

_HDR = struct.Struct("!I")
MAX_FRAME = 16 << 20
#: Largest first (authentication) frame: nothing is buffered for a client before it
#: proved it holds the token.
MAX_AUTH_FRAME = 4096
#: Connections allowed to be in their authentication phase at once (more are dropped),
#: and how long one may take.
MAX_UNAUTHENTICATED = 64
AUTH_TIMEOUT_S = 10.0


class _BadFrame(ValueError):
    """A frame that is not a JSON object within the limits, or a malformed request."""


#: Limits of the elastic requests: a notice's or a decision value's length, a
#: decision's key length, how many decisions may be open at once, and the most ranks
#: one request may name.
MAX_NOTICE = 1024
MAX_DECISION_KEY = 256
MAX_OPEN_DECISIONS = 4096
MAX_NAMED_RANKS = 1 << 20

#: The fields each request needs, with their JSON types.
_FIELDS: dict[Any, tuple[tuple[str, type], ...]] = {
    "set": (("key", str), ("value", str)), "get": (("key", str),),
    "add": (("key", str), ("amount", int)), "join": (("rank", int),),
    "notify": (("to", list), ("value", str)),
    "decide": (("key", str), ("members", list), ("value", str))}


def _ranks_field(msg: dict, name: str) -> list[int]:
    """A request's list of ranks: non-negative ints, at most MAX_NAMED_RANKS."""
    ranks = msg[name]
    if len(ranks) > MAX_NAMED_RANKS or not all(type(r) is int and r >= 0 for r in ranks):
        raise _BadFrame(f"{msg.get('op')}: {name} must list at most {MAX_NAMED_RANKS} "
                        "non-negative integer ranks")
    return ranks


class _Decision:
    """One open ``decide``: its members, the values sent so far, who waits."""

    __slots__ = ("gone", "lives", "members", "values", "waiters")

    def __init__(self, members: frozenset[int], lives: dict[int, int], gone: set[int]
                 ) -> None:
        self.members = members
        #: Which life of each member's rank the decision is among (a replacement that
        #: joined since is another member, of later decisions).
        self.lives = lives
        #: The members gone since the decision opened (or before): a rank that joins
        #: again later (a replacement) is a new member of later decisions, not of this.
        self.gone = gone
        self.values: dict[int, str] = {}
        self.waiters: list[tuple[asyncio.StreamWriter, Any]] = []


async def _read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> dict:
    hdr = await reader.readexactly(_HDR.size)
    (n,) = _HDR.unpack(hdr)
    if n > limit:
        raise _BadFrame(f"store frame of {n} bytes is too large (limit {limit})")
    try:
        msg = json.loads(await reader.readexactly(n))
    except (ValueError, RecursionError) as exc:  # (deep nesting: RecursionError)
        raise _BadFrame(f"malformed store frame: {exc}") from None
    if not isinstance(msg, dict):
        raise _BadFrame(f"a store frame must be a JSON object, got {type(msg).__name__}")
    return msg


def _encode(msg: dict) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode()
    return _HDR.pack(len(data)) + data


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


class StoreServer:
    """The store's server side. Start with :meth:`start`; stop with :meth:`close`.

    Parameters
    ----------
    token : str
        Shared secret every client must present.
    host : str
        Address to bind (``"0.0.0.0"`` for all interfaces).
    port : int
        Port to bind; 0 picks a free one (see :attr:`port`).
    """

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0) -> None:
        if not token:
            raise ValueError("the store needs a non-empty token")
        self._token = token.encode()
        self._host, self._port = host, port
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._clients: set[asyncio.StreamWriter] = set()
        self._ranks: dict[asyncio.StreamWriter, int] = {}
        self._server: asyncio.base_events.Server | None = None
        self.dead: list[int] = []
        self.left: list[int] = []
        self._gone_waiters: list[asyncio.Future] = []
        self._unauthenticated = 0
        self._exiting: set[asyncio.StreamWriter] = set()
        self._decisions: dict[str, _Decision] = {}
        #: How many times each rank joined: a replacement's life is its predecessor's
        #: plus one, and every death event names the life that ended.
        self._lives: dict[int, int] = {}
        self._life_of: dict[asyncio.StreamWriter, int] = {}

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> StoreServer:
        try:
            self._server = await asyncio.start_server(
                self._serve, self._host, self._port, reuse_address=True)
        except OSError as exc:
            raise BootstrapError(
                f"cannot host the bootstrap store on {self._host}:{self._port}: {exc}"
            ) from exc
        return self

    @property
    def joined(self) -> list[int]:
        """Ranks whose liveness connection is open now."""
        return sorted(self._ranks.values())

    async def wait_until_gone(self, nranks: int, timeout: float) -> None:
        """Return once ``nranks`` joined ranks have left or died (or after ``timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.left) + len(self.dead) < nranks and loop.time() < deadline:
            fut = loop.create_future()
            self._gone_waiters.append(fut)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await fut

    def _notify_gone(self, rank: int, life: int | None) -> None:
        waiters, self._gone_waiters = self._gone_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        for key, d in list(self._decisions.items()):
            if rank in d.members and d.lives[rank] == life:
                d.gone.add(rank)
                self._try_decide(key)

    def _try_decide(self, key: str) -> None:
        """Answer decision ``key`` once every member has sent its value or is gone."""
        d = self._decisions[key]
        gone = d.gone
        if not d.members <= gone | d.values.keys():
            return
        del self._decisions[key]
        answer = {"ok": True, "dead": sorted(gone),
                  "values": {str(r): v for r, v in d.values.items() if r not in gone}}
        for writer, rid in d.waiters:
            with contextlib.suppress(Exception):
                writer.write(_encode(dict(answer, id=rid)))

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for w in list(self._clients):
            w.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        stopping = False
        try:
            if self._unauthenticated >= MAX_UNAUTHENTICATED:
                log.warning("store: too many unauthenticated connections; dropped %s", peer)
                return
            self._unauthenticated += 1
            try:
                msg = await asyncio.wait_for(_read_frame(reader, MAX_AUTH_FRAME),
                                             AUTH_TIMEOUT_S)
            finally:
                self._unauthenticated -= 1
            token = msg.get("token") if msg.get("op") == "auth" else None
            token = token.encode() if isinstance(token, str) else b""
            if not hmac.compare_digest(token, self._token):
                log.warning("store: refused a client without the job token from %s", peer)
                writer.write(_encode({"ok": False, "error": "bad or missing job token"}))
                await writer.drain()
                return
            writer.write(_encode({"ok": True}))
            watch_liveness(writer)
            self._clients.add(writer)
            while True:
                msg = await _read_frame(reader)
                await self._handle(msg, writer)
        except _BadFrame as exc:
            log.warning("store: dropped %s: %s", peer, exc)
        except (asyncio.IncompleteReadError, OSError):  # (ETIMEDOUT: watch_liveness)
            pass
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("store: dropped %s after a malformed request (%s: %s)", peer,
                        type(exc).__name__, exc)
        except asyncio.CancelledError:
            # The store's own process is shutting down (asyncio.run cancels what is
            # left): nobody died; tell the client the store is going. Not re-raised:
            # Python 3.11's stream server logs a traceback for every cancelled handler.
            stopping = True
            with contextlib.suppress(Exception):
                writer.write(_encode({"event": "closing"}))
        finally:
            self._clients.discard(writer)
            exiting = writer in self._exiting
            self._exiting.discard(writer)
            rank = self._ranks.pop(writer, None)
            life = self._life_of.pop(writer, None)
            if rank is not None and not stopping:
                self.dead.append(rank)
                log.info("store: rank %d disconnected without leaving", rank)
                event = _encode({"event": "exited" if exiting else "dead", "rank": rank,
                                 "life": life})
                for w in list(self._clients):
                    with contextlib.suppress(Exception):
                        w.write(event)
                self._notify_gone(rank, life)
            writer.close()
            if not stopping:
                # Retrieve how the connection ended (a reset client: ConnectionResetError).
                # Left to the stream protocol's __del__, the garbage collector sometimes
                # finalized the future first: 'Future exception was never retrieved' at
                # Ctrl-C (tests/test_interrupt.py, 1 run in ~100 in CI).
                # Cancelled meanwhile (the process is shutting down): end quietly, as
                # above, not cancelled (Python 3.11 would print a traceback).
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(writer.wait_closed(), 5.0)

    async def _handle(self, msg: dict, writer: asyncio.StreamWriter) -> None:
        op, rid = msg.get("op"), msg.get("id")
        if rid is not None and type(rid) is not int:
            raise _BadFrame(f"request id {rid!r} is not an integer")
        for name, kind in _FIELDS.get(op, ()):
            if type(msg.get(name)) is not kind:
                raise _BadFrame(f"{op}: {name} must be a {kind.__name__}, got "
                                f"{type(msg.get(name)).__name__}")
        if op == "set":
            key = msg["key"]
            self._data[key] = base64.b64decode(msg["value"])
            for fut in self._waiters.pop(key, []):
                if not fut.done():
                    fut.set_result(None)
            writer.write(_encode({"id": rid, "ok": True}))
        elif op == "get":
            # Answer asynchronously so one waiting get never blocks this connection.
            asyncio.get_running_loop().create_task(self._get(msg["key"], rid, writer))
        elif op == "add":
            key = msg["key"]
            value = int(self._data.get(key, b"0")) + int(msg["amount"])
            self._data[key] = str(value).encode()
            for fut in self._waiters.pop(key, []):
                if not fut.done():
                    fut.set_result(None)
            writer.write(_encode({"id": rid, "ok": True, "value": value}))
        elif op == "join":
            rank = int(msg["rank"])
            holder = next((w for w, r in self._ranks.items() if r == rank), None)
            if holder is not None and holder is not writer:
                # A rank's liveness connection cannot be taken over (a stranger who
                # joined as an existing rank and dropped would declare it dead).
                log.warning("store: refused a second join as rank %d from %s", rank,
                            writer.get_extra_info("peername"))
                writer.write(_encode({"id": rid, "ok": False,
                                      "error": f"rank {rank} has already joined"}))
            else:
                if writer not in self._ranks:  # (a second join on one connection: no-op)
                    # A rank joining again is its replacement: alive from now on.
                    self.dead[:] = [r for r in self.dead if r != rank]
                    self.left[:] = [r for r in self.left if r != rank]
                    self._lives[rank] = self._lives.get(rank, 0) + 1
                    self._life_of[writer] = self._lives[rank]
                self._ranks[writer] = rank
                writer.write(_encode({
                    "id": rid, "ok": True, "dead": self.dead, "life": self._life_of[writer],
                    "dead_lives": [[r, self._lives.get(r, 1)] for r in self.dead]}))
        elif op == "notify":
            to = set(_ranks_field(msg, "to"))
            sender = self._ranks.get(writer)
            if sender is None or len(msg["value"]) > MAX_NOTICE:
                raise _BadFrame("notify: only a joined rank may send a notice, of at most "
                                f"{MAX_NOTICE} characters")
            event = _encode({"event": "notice", "from": sender, "value": msg["value"]})
            for w, r in list(self._ranks.items()):
                if r in to and w is not writer:
                    with contextlib.suppress(Exception):
                        w.write(event)
        elif op == "decide":
            self._decide(msg, rid, writer)
        elif op == "exiting":
            # The rank's process is ending without having closed: its drop will be
            # reported as an exit (peers fail what they wait from it, quietly), not as a
            # death. No answer: the process may be gone before it could read one.
            self._exiting.add(writer)
        elif op == "leave":
            gone = self._ranks.pop(writer, None)
            life = self._life_of.pop(writer, None)
            if gone is not None:
                self.left.append(gone)
                self._notify_gone(gone, life)
            writer.write(_encode({"id": rid, "ok": True}))
        else:
            writer.write(_encode({"id": rid, "ok": False, "error": f"unknown op {op!r}"}))

    def _decide(self, msg: dict, rid: Any, writer: asyncio.StreamWriter) -> None:
        key, value = msg["key"], msg["value"]
        ranks = _ranks_field(msg, "members")
        members = frozenset(ranks)
        given = msg.get("lives")
        if given is None:  # (the lives holding the ranks now)
            lives = {m: self._lives.get(m, 1) for m in members}
        elif (isinstance(given, list) and len(given) == len(ranks)
              and all(type(x) is int and x >= 1 for x in given)):
            lives = dict(zip(ranks, given, strict=True))
        else:
            raise _BadFrame("decide: lives must list one life (an int >= 1) per member")
        rank = self._ranks.get(writer)
        error = None
        if len(key) > MAX_DECISION_KEY or len(value) > MAX_NOTICE:
            raise _BadFrame(f"decide: a key of at most {MAX_DECISION_KEY} and a value of "
                            f"at most {MAX_NOTICE} characters")
        d = self._decisions.get(key)
        if rank is None or rank not in members or lives[rank] != self._life_of.get(writer):
            error = "decide: only a joined rank among the members may take part"
        elif d is None and len(self._decisions) >= MAX_OPEN_DECISIONS:
            error = f"decide: {MAX_OPEN_DECISIONS} decisions are open already"
        elif d is not None and (d.members != members or d.lives != lives):
            error = f"decide {key!r}: the members differ from another rank's"
        elif d is not None and rank in d.values:
            error = f"decide {key!r}: rank {rank} has taken part already"
        if error is not None or rank is None:
            writer.write(_encode({"id": rid, "ok": False, "error": error}))
            return
        if d is None:
            ended = set(self.dead) | set(self.left)
            gone = {m for m in members
                    if self._lives.get(m, 0) > lives[m]
                    or (self._lives.get(m, 0) == lives[m] and m in ended)}
            d = self._decisions[key] = _Decision(members, lives, gone)
        d.values[rank] = value
        d.waiters.append((writer, rid))
        self._try_decide(key)

    async def _get(self, key: str, rid: Any, writer: asyncio.StreamWriter) -> None:
        while key not in self._data:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(key, []).append(fut)
            await fut
        with contextlib.suppress(Exception):
            writer.write(_encode({"id": rid, "ok": True, "value": _b64(self._data[key])}))


class StoreClient:
    """Client of :class:`StoreServer`. Create with :meth:`connect`.

    ``on_dead(rank, quiet, life)`` is called (on the event loop) when the store reports
    that a joined rank dropped without leaving (``quiet``: its process announced that it
    was exiting, so it did not crash silently; ``life``: which of the rank's joins ended,
    1 for the first: a replacement's is its predecessor's plus one). ``on_lost(closing)``
    when the connection to the store drops (``closing``: the store said it was shutting
    down).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 address: str) -> None:
        self._reader, self._writer = reader, writer
        self.address = address
        self._next = 0
        self._pending: dict[int, asyncio.Future] = {}
        self.on_dead: Callable[[int, bool, int | None], None] | None = None
        #: After :meth:`join`: this connection's life as its rank (1: the rank's first
        #: join), and ``(rank, life)`` of the ranks dead then.
        self.life = 0
        self.dead_lives: list[tuple[int, int]] = []
        self.on_lost: Callable[[bool], None] | None = None
        #: Called with ``(sender rank, value)`` for each notice relayed to this rank.
        self.on_notice: Callable[[int, str], None] | None = None
        self._store_closing = False
        self._leaving = False
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, host: str, port: int, token: str, timeout: float = 60.0
                      ) -> StoreClient:
        """Connect (retrying while the store is not up yet) and authenticate.

        Raises
        ------
        BootstrapError
            The store refused the token.
        CommTimeoutError
            The store could not be reached within ``timeout`` seconds.
        """
        deadline = Deadline(timeout, f"bootstrap store {host}:{port}")
        delay = 0.01
        last: BaseException | None = None
        while True:
            left = deadline.left()
            try:
                reader, writer = await within(asyncio.open_connection(host, port),
                                              None if left is None else max(0.1, left),
                                              "connect")
                break
            except (OSError, CommTimeoutError) as exc:
                last = exc
            left = deadline.left()
            if left is not None and left < delay:
                raise CommTimeoutError(
                    f"bootstrap store {host}:{port} unreachable for {timeout:g} s: {last}")
            await asyncio.sleep(delay)  # retry backoff, not a wait for a condition
            delay = min(delay * 2, 0.5)
        writer.write(_encode({"op": "auth", "token": token}))
        try:
            reply = await within(_read_frame(reader), timeout, "handshake", message=(
                f"bootstrap store {host}:{port} did not answer the handshake within "
                f"{timeout:g} s"))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.close()
            raise BootstrapError(f"bootstrap store {host}:{port} closed the connection") \
                from exc
        except BaseException:
            writer.close()
            raise
        if not reply.get("ok"):
            writer.close()
            raise BootstrapError(f"bootstrap store {host}:{port} refused us: "
                                 f"{reply.get('error')} (check UCXCOMM_TOKEN)")
        watch_liveness(writer)
        return cls(reader, writer, f"{host}:{port}")

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await _read_frame(self._reader)
                if "event" in msg:
                    event = msg["event"]
                    if event in ("dead", "exited") and self.on_dead is not None:
                        life = msg.get("life")
                        self.on_dead(int(msg["rank"]), event == "exited",
                                     life if type(life) is int else None)
                    elif event == "closing":
                        self._store_closing = True
                    elif (event == "notice" and self.on_notice is not None
                          and type(msg.get("from")) is int
                          and type(msg.get("value")) is str):
                        self.on_notice(msg["from"], msg["value"])
                    continue
                rid = msg.get("id")
                fut = self._pending.pop(rid, None) if isinstance(rid, int) else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (asyncio.IncompleteReadError, OSError, ValueError):  # (OSError: ETIMEDOUT
            pass                                                   # from watch_liveness)
        except asyncio.CancelledError:
            # This process's event loop is ending without close(): say so, so that the
            # store reports an exit rather than a death (written at once, unanswered).
            if not self._leaving:
                self._leaving = True
                with contextlib.suppress(Exception):
                    self._writer.write(_encode({"op": "exiting"}))
            raise
        finally:
            err = BootstrapError(f"lost the connection to the bootstrap store {self.address}")
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(err)
            self._pending.clear()
            if not self._leaving and self.on_lost is not None:
                self.on_lost(self._store_closing)

    async def _call(self, msg: dict, timeout: float | None) -> dict:
        if self._task.done():
            raise BootstrapError(f"no connection to the bootstrap store {self.address}")
        self._next += 1
        msg["id"] = self._next
        fut = asyncio.get_running_loop().create_future()
        self._pending[self._next] = fut
        self._writer.write(_encode(msg))
        try:
            reply = await within(fut, timeout, msg["op"], message=(
                f"bootstrap store {self.address}: {msg['op']} {msg.get('key', '')!r} "
                f"got no answer in {timeout or 0:g} s"))
        except CommTimeoutError:
            self._pending.pop(msg["id"], None)
            raise
        if not reply.get("ok"):
            raise BootstrapError(f"bootstrap store error: {reply.get('error')}")
        return reply

    async def set(self, key: str, value: bytes, timeout: float | None = 60.0) -> None:
        await self._call({"op": "set", "key": key, "value": _b64(value)}, timeout)

    async def get(self, key: str, timeout: float | None = 60.0) -> bytes:
        """The value of ``key``, waiting until some client sets it."""
        reply = await self._call({"op": "get", "key": key}, timeout)
        return base64.b64decode(reply["value"])

    async def add(self, key: str, amount: int = 1, timeout: float | None = 60.0) -> int:
        reply = await self._call({"op": "add", "key": key, "amount": amount}, timeout)
        return int(reply["value"])

    async def join(self, rank: int, timeout: float | None = 60.0) -> list[int]:
        """Register this connection as ``rank``'s liveness watch; returns ranks already dead."""
        reply = await self._call({"op": "join", "rank": rank}, timeout)
        life = reply.get("life")
        self.life = life if type(life) is int else 1
        pairs = reply.get("dead_lives")
        self.dead_lives = [(p[0], p[1]) for p in pairs
                           if isinstance(p, list) and len(p) == 2
                           and type(p[0]) is int and type(p[1]) is int] \
            if isinstance(pairs, list) else []
        return [int(r) for r in reply.get("dead", [])]

    def notify(self, to: list[int], value: str) -> None:
        """Relay ``value`` to the joined ranks ``to`` (not answered, not awaited: written
        at once; nothing when the connection is gone)."""
        if not self._task.done():
            self._writer.write(_encode({"op": "notify", "to": to, "value": value}))

    async def decide(self, key: str, members: list[int], value: str,
                     timeout: float | None, lives: list[int] | None = None
                     ) -> tuple[dict[int, str], list[int]]:
        """Take part in decision ``key`` among ``members`` (this rank one of them) with
        ``value``: ``({rank: value} of the members alive when it was decided, [the
        members gone])``, the same for every member that gets an answer. ``lives``: which
        life of each member's rank (default: the ones holding them now)."""
        msg: dict[str, Any] = {"op": "decide", "key": key, "members": members,
                               "value": value}
        if lives is not None:
            msg["lives"] = lives
        reply = await self._call(msg, timeout)
        values, dead = reply.get("values"), reply.get("dead")
        if not isinstance(values, dict) or not isinstance(dead, list):
            raise BootstrapError(f"bootstrap store {self.address}: a malformed decision")
        try:
            return ({int(r): str(v) for r, v in values.items()},
                    [int(r) for r in dead])
        except (TypeError, ValueError):
            raise BootstrapError(f"bootstrap store {self.address}: a malformed decision") \
                from None

    async def leave(self, timeout: float | None = 10.0) -> None:
        self._leaving = True
        with contextlib.suppress(Exception):
            await self._call({"op": "leave"}, timeout)

    async def close(self) -> None:
        self._leaving = True
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task

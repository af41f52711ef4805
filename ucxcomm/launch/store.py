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

Standby. Where a rank hosts the store (rank 0 under torchrun, Slurm, MPI launchers),
rank 1 runs a standby: a second server that sends ``{"op": "replicate"}`` and gets the
primary's state (``snapshot``), then every change as ``{"event": "repl"}`` frames, in
order (keys set and counted, joins with their lives, drops and leaves, decision
contributions, and each decision's answer before the members get it). Clients that
lose the primary connect to the standby (``StoreClient.standby``), join again as the
same rank and life, and send their unanswered requests again: a contribution the
standby holds already, or a decision it has the answer of, is answered, and an ``add``
carries a request id so that it is never counted twice. When the standby's own link to
the primary drops, it takes over: the primary's host rank is dead, every rank joined
there that has not come back within ``FAILOVER_GRACE_S`` too, open decisions are
decided there, and it listens on the primary's address as well where it can (a
replacement of rank 0 finds it there). A standby names its rank and address in its
``replicate`` request; the store tells every client (``{"event": "standby"}``, and in
the answer to a ``join``). When the standby's link drops without ``leave`` (its rank
died), or a standby took over, the store elects the next one: the lowest joined rank
other than its own host's gets ``{"event": "standby-wanted"}`` and starts one
(``bootstrap``), again if that rank dies first. It does not survive the primary and the
standby dying together, nor within the few milliseconds of an election.

Partitions. A killed process's kernel closes its connections (an end of stream), but
a cut link or a dead host sends nothing: the connection ends silently, at
``UCXCOMM_LIVENESS_S`` (``_net.watch_liveness``), and the two sides cannot tell a dead
peer from one on the other side of a partition; once the link heals, a peer whose side
timed out answers with a reset, so a reset counts as silent too (``_silent_loss``). A
store that a member rank hosts (the primary on rank 0, the standby on rank 1) may itself
be on the minority side, so it is created with ``fence=True``: it refuses a decision
(``{"ok": false, "fenced": true}``) whose members lost silently are half of its members
or more, and the members on that side fail instead of going on as a second job. A store
outside the ranks (the launcher's) is the arbiter itself: a rank that cannot reach it
cannot decide anything.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
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
#: Failover to the standby store: how long a client tries to reach it, and how long
#: the standby waits for the ranks joined at the primary to come back before it
#: declares them dead.
FAILOVER_CONNECT_S = 5.0
#: Decisions' answers kept for members that ask again after a failover.
MAX_ANSWERS = 1024
FAILOVER_GRACE_S = 5.0

#: The fields each request needs, with their JSON types.
_FIELDS: dict[Any, tuple[tuple[str, type], ...]] = {
    "set": (("key", str), ("value", str)), "get": (("key", str),),
    "add": (("key", str), ("amount", int)), "join": (("rank", int),),
    "notify": (("to", list), ("value", str)),
    "decide": (("key", str), ("members", list), ("value", str))}


def _silent_loss(exc: BaseException | None) -> bool:
    """Whether a connection ended in a way a partition can cause, rather than with an end
    of stream (a process that died on a live kernel): a liveness timeout, the network
    saying the host is unreachable, or a reset. A reset is what a peer sends once a
    link heals after its side of the connection timed out during the cut (the fuzzer
    found that split brain: rank 0 cut off, healed 1.6 s later, took its peers' resets
    for deaths and went on alone); a process killed with data unread also resets, and
    is then counted as silent: fencing errs toward stopping, never toward two jobs."""
    return isinstance(exc, OSError) and exc.errno in (
        errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN,
        errno.ECONNRESET, errno.EPIPE)


def _ranks_field(msg: dict, name: str) -> list[int]:
    """A request's list of ranks: non-negative ints, at most MAX_NAMED_RANKS."""
    ranks = msg[name]
    if len(ranks) > MAX_NAMED_RANKS or not all(type(r) is int and r >= 0 for r in ranks):
        raise _BadFrame(f"{msg.get('op')}: {name} must list at most {MAX_NAMED_RANKS} "
                        "non-negative integer ranks")
    return ranks


class _Decision:
    """One open ``decide``: its members, the values sent so far, who waits."""

    __slots__ = ("gone", "lives", "members", "values", "waiters", "writers")

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
        #: The connection each value came on (None: replicated from the primary).
        self.writers: dict[int, asyncio.StreamWriter | None] = {}


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
    fence : bool
        A member rank hosts this store (module doc, "Partitions"): refuse decisions
        whose members lost silently are half of the members or more.
    """

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0,
                 fence: bool = False) -> None:
        if not token:
            raise ValueError("the store needs a non-empty token")
        self._token = token.encode()
        self._host, self._port = host, port
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._clients: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task] = set()  # (one per connection: _accept)
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
        #: Standby replication (module doc, "Standby"): the primary's connection to its
        #: standby; the standby's state while it follows, the answers of decisions it
        #: holds for members that ask again after a failover, and the ranks (and lives)
        #: joined at the primary that have not come back yet.
        self._replica: asyncio.StreamWriter | None = None
        self.following = False
        self._answers: dict[str, dict] = {}
        self._added: dict[str, int] = {}  # (standby) request -> the count it got
        self._awaiting: dict[int, int] = {}
        self._extra: list[Any] = []
        #: Ranks (and the life) whose connection ended silently (``_silent_loss``).
        self.fence = fence
        self._silent: dict[int, int] = {}
        #: The rank whose process hosts this store (None: no rank does, a launcher);
        #: the current standby's rank and ``host:port``, and the rank asked to start one.
        self.host_rank: int | None = None
        self._replica_rank: int | None = None
        self.standby_address: str | None = None
        self._wanted: int | None = None
        self._keep_standby = False  # (once a standby followed, or this one took over)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> StoreServer:
        try:
            self._server = await asyncio.start_server(
                self._accept, self._host, self._port, reuse_address=True)
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

    # ------------------------------------------------------------------ standby
    def _set(self, key: str, value: bytes) -> None:
        self._data[key] = value
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(None)

    def _repl(self, change: dict) -> None:
        """Send a state change to the standby that follows this store (if any)."""
        if self._replica is not None:
            with contextlib.suppress(Exception):
                self._replica.write(_encode({"event": "repl", **change}))

    def _snapshot(self) -> dict:
        return {"data": {k: _b64(v) for k, v in self._data.items()},
                "lives": {str(r): n for r, n in self._lives.items()},
                # (ranks awaited after a failover are joined here as far as a standby
                # of this store knows: it awaits them too)
                "joined": {**{str(r): n for r, n in self._awaiting.items()},
                           **{str(r): self._life_of.get(w, 1) for w, r in self._ranks.items()}},
                "dead": self.dead, "left": self.left,
                "silent": {str(r): n for r, n in self._silent.items()},
                "decisions": [{"key": k, "members": sorted(d.members),
                               "lives": [d.lives[m] for m in sorted(d.members)],
                               "values": {str(r): v for r, v in d.values.items()},
                               "gone": sorted(d.gone)} for k, d in self._decisions.items()]}

    def load(self, snap: dict) -> None:
        """(A standby.) The primary's state, from its snapshot."""
        self.following = True
        for k, v in snap["data"].items():
            self._set(k, base64.b64decode(v))
        self._lives.update({int(r): int(n) for r, n in snap["lives"].items()})
        self._awaiting.update({int(r): int(n) for r, n in snap["joined"].items()})
        self.dead[:] = [int(r) for r in snap["dead"]]
        self.left[:] = [int(r) for r in snap["left"]]
        self._silent.update({int(r): int(n) for r, n in snap.get("silent", {}).items()})
        for d in snap["decisions"]:
            members = [int(m) for m in d["members"]]
            dec = self._decisions[d["key"]] = _Decision(
                frozenset(members), dict(zip(members, d["lives"], strict=True)),
                {int(m) for m in d["gone"]})
            for r, v in d["values"].items():
                dec.values[int(r)] = v
                dec.writers[int(r)] = None

    def apply(self, change: dict) -> None:
        """(A standby.) One state change its primary sent (``_repl``)."""
        op = change.get("op")
        if op == "set":
            self._set(change["key"], base64.b64decode(change["value"]))
            req = change.get("req")
            if isinstance(req, str):
                self._added[req] = int(change["added"])
                while len(self._added) > MAX_OPEN_DECISIONS:
                    del self._added[next(iter(self._added))]
        elif op == "join":
            rank, life = int(change["rank"]), int(change["life"])
            self.dead[:] = [r for r in self.dead if r != rank]
            self.left[:] = [r for r in self.left if r != rank]
            self._lives[rank] = life
            self._awaiting[rank] = life
        elif op == "gone":
            rank, ended = int(change["rank"]), change.get("life")
            if self._awaiting.get(rank) == ended:
                del self._awaiting[rank]
            (self.left if change.get("how") == "left" else self.dead).append(rank)
            if change.get("silent") is True and type(ended) is int:
                self._silent[rank] = ended
            self._notify_gone(rank, ended)
        elif op == "contrib":
            members = [int(m) for m in change["members"]]
            key = change["key"]
            d = self._decisions.get(key)
            if d is None:
                lives = dict(zip(members, change["lives"], strict=True))
                ended = set(self.dead) | set(self.left)
                d = self._decisions[key] = _Decision(frozenset(members), lives, {
                    m for m in members if self._lives.get(m, 0) > lives[m]
                    or (self._lives.get(m, 0) == lives[m] and m in ended)})
            d.values[int(change["rank"])] = change["value"]
            d.writers.setdefault(int(change["rank"]), None)
        elif op == "answer":
            key = change["key"]
            d = self._decisions.pop(key, None)
            self._remember(key, change["answer"])
            for writer, rid in d.waiters if d is not None else ():
                with contextlib.suppress(Exception):
                    writer.write(_encode(dict(change["answer"], id=rid)))

    def take_over(self, host_rank: int | None, grace: float,
                  also: tuple[str, int] | None = None, silent: bool = False) -> None:
        """(A standby whose primary is gone.) Serve from now on: the primary's host
        rank is dead (``silent``: the link to it ended silently, "Partitions"); the
        ranks that were joined there and do not come back within ``grace`` seconds are
        dead too (silently); open decisions are decided here. ``also``: the primary's
        own address, listened on as well where this host can (replacements that know
        only it find this store there)."""
        if not self.following:
            return
        self.following = False
        loop = asyncio.get_running_loop()
        if host_rank is not None and host_rank in self._awaiting:
            self._declare_dead(host_rank, self._awaiting.pop(host_rank), silent)
        loop.call_later(grace, self._give_up_awaiting)
        for key in list(self._decisions):
            if key in self._decisions:
                self._try_decide(key)
        self._replica = self._replica_rank = self.standby_address = None
        self._keep_standby = True
        self._elect()  # (and at each rank's return, until one is found)
        if also is not None:
            self._extra.append(loop.create_task(self._listen_also(*also, grace)))

    def _elect(self, unlike: int | None = None) -> None:
        """Ask the lowest joined rank other than this store's host (and ``unlike``: the
        rank of a standby just gone) to start a standby (module doc, "Standby"); nothing
        where no rank hosts this store, before any standby followed it, while one
        follows, or when no rank is left to ask."""
        if (self.host_rank is None or not self._keep_standby or self.following
                or self._replica is not None):
            return
        ranks = {r: w for w, r in self._ranks.items() if r not in (self.host_rank, unlike)}
        self._wanted = min(ranks, default=None)
        if self._wanted is None:
            return
        log.info("store: rank %d is asked to keep the standby", self._wanted)
        with contextlib.suppress(Exception):
            ranks[self._wanted].write(_encode({"event": "standby-wanted",
                                               "host": self.host_rank}))

    def _remember(self, key: str, answer: dict) -> None:
        """Keep a decision's answer for a member that asks again (after a failover, its
        request may reach the standby after the others decided), the last
        ``MAX_ANSWERS`` of them."""
        self._answers[key] = answer
        while len(self._answers) > MAX_ANSWERS:
            del self._answers[next(iter(self._answers))]

    def _declare_dead(self, rank: int, life: int, silent: bool) -> None:
        self.dead.append(rank)
        if silent:
            self._silent[rank] = life
        self._repl({"op": "gone", "rank": rank, "life": life, "how": "dead",
                    "silent": silent})
        event = _encode({"event": "dead", "rank": rank, "life": life})
        for w in list(self._clients):
            with contextlib.suppress(Exception):
                w.write(event)
        self._notify_gone(rank, life)

    def _give_up_awaiting(self) -> None:
        for rank, life in list(self._awaiting.items()):
            del self._awaiting[rank]
            log.warning("store (standby): rank %d did not come back after the failover",
                        rank)
            self._declare_dead(rank, life, True)

    async def _listen_also(self, host: str, port: int, within_s: float) -> None:
        """Listen on the primary's address too, retrying for ``within_s`` seconds: the
        dead primary's connections hold its port until their clients close them (they
        do as they fail over here; the bind failed with EADDRINUSE about 1 time in 5
        when it was tried only once)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within_s
        delay = 0.01
        while True:
            try:
                self._extra.append(await asyncio.start_server(self._accept, host, port,
                                                              reuse_address=True))
                return
            except OSError as exc:  # (another host's address, or the port still held)
                if loop.time() + delay > end or exc.errno != errno.EADDRINUSE:
                    log.info("store (standby): not listening on the primary's address "
                             "%s:%d too (%s)", host, port, exc)
                    return
            await asyncio.sleep(delay)  # retry backoff, not a wait for a condition
            delay = min(2 * delay, 0.2)

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
        """Answer decision ``key`` once every member has sent its value or is gone (a
        standby that follows leaves that to its primary)."""
        if self.following:
            return
        d = self._decisions[key]
        gone = d.gone
        if not d.members <= gone | d.values.keys():
            return
        del self._decisions[key]
        silent = sorted(m for m in gone if self._silent.get(m) == d.lives[m])
        if self.fence and len(d.members) > 1 and 2 * len(silent) >= len(d.members):
            answer = {"ok": False, "fenced": True, "error": (
                f"ranks {silent} of the {len(d.members)} members went silent (a cut link "
                "or a dead host): this side of the job may be the minority of a network "
                "partition, so it stops here")}
        else:
            answer = {"ok": True, "dead": sorted(gone),
                      "values": {str(r): v for r, v in d.values.items() if r not in gone}}
        self._repl({"op": "answer", "key": key, "answer": answer})
        self._remember(key, answer)
        for writer, rid in d.waiters:
            with contextlib.suppress(Exception):
                writer.write(_encode(dict(answer, id=rid)))

    async def close(self) -> None:
        if self._server is None:
            return
        for extra in self._extra:
            if isinstance(extra, asyncio.Task):
                extra.cancel()
            else:
                extra.close()
        self._server.close()
        for w in list(self._clients):
            w.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        self._server = None

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection's handler task, made here rather than by the stream server:
        Python 3.11's server logs a traceback for a handler task cancelled before it
        first ran (a connection accepted as the process shuts down: asyncio.run
        cancels it), which ``_serve`` cannot catch (found by tests/test_faults.py's
        ``test_kill_during[lock-first]``, 1 run in about 10)."""
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        stopping = silent = False
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
        except (asyncio.IncompleteReadError, OSError) as exc:  # (ETIMEDOUT: watch_liveness)
            silent = _silent_loss(exc)
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
            if writer is self._replica:  # (it did not leave: its rank died)
                gone_standby = self._replica_rank
                self._replica = self._replica_rank = self.standby_address = None
                if not stopping:
                    self._elect(unlike=gone_standby)
            elif rank is not None and rank == self._wanted and self._replica is None \
                    and not stopping:
                self._wanted = None
                self._elect()  # (the rank asked died first: the next one)
            if rank is not None and not stopping:
                self.dead.append(rank)
                if silent and life is not None:
                    self._silent[rank] = life
                self._repl({"op": "gone", "rank": rank, "life": life, "how": "dead",
                            "silent": silent})
                log.info("store: rank %d disconnected without leaving%s", rank,
                         " (silently: no reset, no end of stream)" if silent else "")
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
            self._set(key, base64.b64decode(msg["value"]))
            self._repl({"op": "set", "key": key, "value": msg["value"]})
            writer.write(_encode({"id": rid, "ok": True}))
        elif op == "get":
            # Answer asynchronously so one waiting get never blocks this connection.
            asyncio.get_running_loop().create_task(self._get(msg["key"], rid, writer))
        elif op == "add":
            key, req = msg["key"], msg.get("req")
            if req is not None and (type(req) is not str or len(req) > 64):
                raise _BadFrame("add: req must be a string of at most 64 characters")
            if req is not None and req in self._added:  # (sent again after a failover)
                value = self._added[req]
            else:
                value = int(self._data.get(key, b"0")) + int(msg["amount"])
                self._set(key, str(value).encode())
                self._repl({"op": "set", "key": key, "value": _b64(str(value).encode()),
                            "req": req, "added": value})
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
            elif "life" in msg and writer not in self._ranks:
                # Back after a failover (this store was the standby): the same life.
                life = msg["life"]
                if type(life) is not int or self._awaiting.get(rank) != life:
                    writer.write(_encode({"id": rid, "ok": False, "error": (
                        f"rank {rank}: life {life!r} is not one this store awaits")}))
                    return
                del self._awaiting[rank]
                self._life_of[writer] = life
                self._ranks[writer] = rank
                self._repl({"op": "join", "rank": rank, "life": life})
                writer.write(_encode({
                    "id": rid, "ok": True, "dead": self.dead, "life": life,
                    "dead_lives": [[r, self._lives.get(r, 1)] for r in self.dead],
                    "standby": self.standby_address}))
                if self._wanted is None:
                    self._elect()
            else:
                if writer not in self._ranks:  # (a second join on one connection: no-op)
                    # A rank joining again is its replacement: alive from now on.
                    self.dead[:] = [r for r in self.dead if r != rank]
                    self.left[:] = [r for r in self.left if r != rank]
                    old = self._awaiting.pop(rank, None)
                    if old is not None:  # (its predecessor never came back: gone)
                        self._notify_gone(rank, old)
                    self._lives[rank] = self._lives.get(rank, 0) + 1
                    self._life_of[writer] = self._lives[rank]
                    self._repl({"op": "join", "rank": rank, "life": self._lives[rank]})
                self._ranks[writer] = rank
                writer.write(_encode({
                    "id": rid, "ok": True, "dead": self.dead, "life": self._life_of[writer],
                    "dead_lives": [[r, self._lives.get(r, 1)] for r in self.dead],
                    "standby": self.standby_address}))
                if self._wanted is None:
                    self._elect()
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
        elif op == "replicate":
            # A standby follows this store from now on: its state first, then every
            # change as it happens (module doc, "Standby").
            by, address = msg.get("rank"), msg.get("address")
            if (by is not None and type(by) is not int) or (
                    address is not None and (type(address) is not str or len(address) > 300
                                             or ":" not in address)):
                raise _BadFrame("replicate: rank must be an int, address a host:port")
            if self._replica is not None and self._replica is not writer:
                writer.write(_encode({"id": rid, "ok": False,
                                      "error": "a standby follows this store already"}))
            else:
                self._replica, self._replica_rank = writer, by
                self._wanted = None
                writer.write(_encode({"id": rid, "ok": True, "snapshot": self._snapshot()}))
                if address is not None:  # (every client fails over there from now on)
                    self._keep_standby = True
                    self.standby_address = address
                    event = _encode({"event": "standby", "address": address})
                    for w in list(self._clients):
                        if w is not writer:
                            with contextlib.suppress(Exception):
                                w.write(event)
        elif op == "exiting":
            # The rank's process is ending without having closed: its drop will be
            # reported as an exit (peers fail what they wait from it, quietly), not as a
            # death. No answer: the process may be gone before it could read one.
            self._exiting.add(writer)
        elif op == "leave":
            if writer is self._replica:  # (the standby closes: no election)
                self._replica = self._replica_rank = self.standby_address = None
            gone = self._ranks.pop(writer, None)
            life = self._life_of.pop(writer, None)
            if gone is not None:
                self.left.append(gone)
                self._repl({"op": "gone", "rank": gone, "life": life, "how": "left"})
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
        if rank is not None and key in self._answers and error is None:
            # (asked again after a failover: the primary had decided)
            writer.write(_encode(dict(self._answers[key], id=rid)))
            return
        if (d is not None and rank is not None and rank in d.values
                and d.writers.get(rank) is not writer and lives[rank] == self._life_of.get(writer)):
            d.waiters.append((writer, rid))  # (asked again after a failover)
            return
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
        d.writers[rank] = writer
        d.waiters.append((writer, rid))
        self._repl({"op": "contrib", "key": key, "members": ranks, "rank": rank,
                    "lives": [lives[m] for m in ranks], "value": value})
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
                 address: str, token: str = "") -> None:
        self._reader, self._writer = reader, writer
        self.address = address
        self._token = token
        self._next = 0
        self._pending: dict[int, asyncio.Future] = {}
        #: The requests not answered yet (sent again to the standby after a failover).
        self._sent: dict[int, dict] = {}
        #: ``(host, port)`` of the standby store to fail over to (None: none); the rank
        #: this connection joined as; notices held while failing over.
        self.standby: tuple[str, int] | None = None
        self._joined_rank: int | None = None
        self._failing_over = False
        self._held: list[dict] = []
        #: (A standby's replication connection.) Called with the primary's snapshot, at
        #: once as it arrives, and with each state change after it.
        self.on_snapshot: Callable[[dict], None] | None = None
        self.on_repl: Callable[[dict], None] | None = None
        self.on_dead: Callable[[int, bool, int | None], None] | None = None
        #: After :meth:`join`: this connection's life as its rank (1: the rank's first
        #: join), and ``(rank, life)`` of the ranks dead then.
        self.life = 0
        self.dead_lives: list[tuple[int, int]] = []
        self.on_lost: Callable[[bool], None] | None = None
        #: Called with ``(sender rank, value)`` for each notice relayed to this rank.
        self.on_notice: Callable[[int, str], None] | None = None
        #: Called with the store's host rank when the store asks this rank to start a
        #: standby of it (module doc, "Standby").
        self.on_standby_wanted: Callable[[int], None] | None = None
        self._store_closing = False
        self._leaving = False
        #: Whether the connection (to the store followed last) ended silently
        #: (module doc, "Partitions"): read by a standby that takes over.
        self.lost_silently = False
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
        return cls(reader, writer, f"{host}:{port}", token)

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    msg = await _read_frame(self._reader)
                except (asyncio.IncompleteReadError, OSError, ValueError) as exc:
                    self.lost_silently = _silent_loss(exc)
                    if await self._fail_over():
                        continue
                    raise
                if "event" in msg:
                    event = msg["event"]
                    if event == "repl" and self.on_repl is not None:
                        try:
                            self.on_repl(msg)
                        except (KeyError, TypeError, ValueError) as exc:
                            log.warning("store (standby): a malformed change from the "
                                        "primary was dropped (%s: %s)",
                                        type(exc).__name__, exc)
                    elif event in ("dead", "exited") and self.on_dead is not None:
                        life = msg.get("life")
                        self.on_dead(int(msg["rank"]), event == "exited",
                                     life if type(life) is int else None)
                    elif event == "closing":
                        self._store_closing = True
                    elif event == "standby":
                        self._set_standby(msg.get("address"))
                    elif event == "standby-wanted" and self.on_standby_wanted is not None \
                            and type(msg.get("host")) is int:
                        self.on_standby_wanted(msg["host"])
                    elif (event == "notice" and self.on_notice is not None
                          and type(msg.get("from")) is int
                          and type(msg.get("value")) is str):
                        self.on_notice(msg["from"], msg["value"])
                    continue
                rid = msg.get("id")
                fut = self._pending.pop(rid, None) if isinstance(rid, int) else None
                if isinstance(rid, int):
                    self._sent.pop(rid, None)
                if "snapshot" in msg and self.on_snapshot is not None and msg.get("ok"):
                    try:
                        self.on_snapshot(msg["snapshot"])  # (before any change after it)
                    except (KeyError, TypeError, ValueError, AttributeError) as exc:
                        msg = {"ok": False, "error": f"a malformed snapshot ({exc})"}
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
        if msg["op"] == "add":  # (a retry after a failover must not add twice)
            msg.setdefault("req", f"{id(self):x}.{self._next}")
        fut = asyncio.get_running_loop().create_future()
        self._pending[self._next] = fut
        self._sent[self._next] = msg
        if not self._failing_over:
            self._writer.write(_encode(msg))
        try:
            reply = await within(fut, timeout, msg["op"], message=(
                f"bootstrap store {self.address}: {msg['op']} {msg.get('key', '')!r} "
                f"got no answer in {timeout or 0:g} s"))
        except CommTimeoutError:
            self._pending.pop(msg["id"], None)
            self._sent.pop(msg["id"], None)
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
        self._joined_rank = rank
        self._set_standby(reply.get("standby"))
        life = reply.get("life")
        self.life = life if type(life) is int else 1
        pairs = reply.get("dead_lives")
        self.dead_lives = [(p[0], p[1]) for p in pairs
                           if isinstance(p, list) and len(p) == 2
                           and type(p[0]) is int and type(p[1]) is int] \
            if isinstance(pairs, list) else []
        return [int(r) for r in reply.get("dead", [])]

    def _set_standby(self, address: Any) -> None:
        """Fail over to ``address`` (``host:port``, from the store) from now on."""
        if type(address) is not str or self._failing_over:
            return
        host, _, port = address.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            self.standby = (host, int(port))

    def notify(self, to: list[int], value: str) -> None:
        """Relay ``value`` to the joined ranks ``to`` (not answered, not awaited: written
        at once; nothing when the connection is gone)."""
        msg = {"op": "notify", "to": to, "value": value}
        if self._failing_over:
            self._held.append(msg)
        elif not self._task.done():
            self._writer.write(_encode(msg))

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

    async def replicate(self, on_snapshot: Callable[[dict], None],
                        on_repl: Callable[[dict], None], timeout: float | None,
                        rank: int | None = None, address: str | None = None) -> None:
        """Follow the store as its standby: ``on_snapshot(state)``, then ``on_repl(change)``
        for every change, in order (``StoreServer.load``/``apply``). ``rank``, ``address``
        (``host:port``): where this standby serves (the store tells every client)."""
        self.on_snapshot, self.on_repl = on_snapshot, on_repl
        msg: dict[str, Any] = {"op": "replicate"}
        if rank is not None:
            msg.update(rank=rank, address=address)
        await self._call(msg, timeout)

    async def _fail_over(self) -> bool:
        """The store's connection dropped: go on with the standby, if there is one and
        this connection did not mean to leave (rejoin as the same rank and life, send
        what was not answered again). False: no failover (the connection is lost)."""
        standby, self.standby = self.standby, None  # (one failover)
        if standby is None or self._leaving or self._store_closing:
            return False
        self._failing_over = True
        try:
            host, port = standby
            try:
                new = await StoreClient._open(host, port, self._token, FAILOVER_CONNECT_S)
            except (BootstrapError, CommTimeoutError, OSError) as exc:
                log.warning("store: the standby %s:%d cannot be reached (%s)", host, port,
                            exc)
                return False
            self._writer.close()
            self._reader, self._writer = new
            log.warning("store: lost the bootstrap store %s; going on with its standby "
                        "%s:%d", self.address, host, port)
            self.address = f"{host}:{port}"
            if self._joined_rank is not None:
                self._next += 1
                fut = asyncio.get_running_loop().create_future()
                self._pending[self._next] = fut
                fut.add_done_callback(self._rejoined)
                self._writer.write(_encode({"op": "join", "rank": self._joined_rank,
                                            "life": self.life, "id": self._next}))
            for rid in sorted(self._sent):
                self._writer.write(_encode(self._sent[rid]))
            for msg in self._held:
                self._writer.write(_encode(msg))
            self._held.clear()
            return True
        finally:
            self._failing_over = False

    def _rejoined(self, fut: asyncio.Future) -> None:
        reply = fut.result() if not fut.cancelled() and fut.exception() is None else {}
        if not reply.get("ok"):
            log.warning("store: the standby refused this rank back (%s)",
                        reply.get("error"))
            self._writer.close()  # (lost: the read loop ends, on_lost is called)
            return
        self._set_standby(reply.get("standby"))
        pairs = reply.get("dead_lives")
        if self.on_dead is not None and isinstance(pairs, list):
            for p in pairs:  # (the primary's host among them)
                if isinstance(p, list) and len(p) == 2 and type(p[0]) is int \
                        and type(p[1]) is int:
                    self.on_dead(p[0], False, p[1])

    @staticmethod
    async def _open(host: str, port: int, token: str, timeout: float
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to a store, authenticated."""
        reader, writer = await within(asyncio.open_connection(host, port), timeout,
                                      "connect")
        writer.write(_encode({"op": "auth", "token": token}))
        try:
            reply = await within(_read_frame(reader), timeout, "handshake")
        except BaseException:
            writer.close()
            raise
        if not reply.get("ok"):
            writer.close()
            raise BootstrapError(f"store {host}:{port} refused us: {reply.get('error')}")
        watch_liveness(writer)
        return reader, writer

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

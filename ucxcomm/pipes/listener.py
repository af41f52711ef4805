"""``listen``/``connect``: endpoints without ranks, for client/server pipelines.

A connection starts as a TCP connection to the listener's socket (ours, not UCX's: UCX's
socket listener parses whatever a client sends, leaked a descriptor per garbage
connection and kept silent ones open for good). On it, in fixed-size frames:

1. **Challenge-response** (when the listener has a ``token``): both sides send a random
   nonce; each proves it holds the shared secret with an HMAC-SHA256 of both nonces
   (different labels per direction, compared in constant time; the secret never
   travels). A wrong or missing token ends the connection on both sides
   (:class:`~ucxcomm.AuthenticationError` for the client, one log line for the
   listener, whose handler never runs).
2. **Hello**: each side's receive namespace (the upper 32 bits of every tag it
   receives on this connection), host identity and UCX worker address; with a token
   each hello carries an HMAC under a key bound to this session's nonces.
3. Each side checks the other's worker address (:mod:`ucxcomm.transport.wire`) and
   creates a UCX endpoint to it: without UCX error handling when both processes share
   a host (shared memory and CMA; DESIGN: failure detection must not cost shared
   memory), with it otherwise. One tag message each way over it finishes UCX's wire-up
   before the connection is handed out (UCX aborts a process whose peer dies while an
   endpoint is still being set up).

The TCP connection then stays open, silent, as the connection's liveness watch: when
it ends (the peer closed, died, or its host fell off the network: keepalive probes,
``UCXCOMM_LIVENESS_S``), every pending and later operation on the connection fails
with :class:`~ucxcomm.PeerFailure`.

Before the handshake completes nothing from the connection is unpickled or parsed beyond
fixed-size frames and a hello of at most :data:`MAX_HELLO` bytes; at most
:data:`MAX_PENDING` connections may be in their handshake at once (more are closed at
once), each for at most the listener's ``timeout``; those that fail are dropped quietly
(one log line, at most one a second, for a wrong token).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import socket
import struct
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from .._deadline import check_timeout, limit
from .._net import host_identity, is_loopback
from ..errors import (
    AuthenticationError,
    ClosedError,
    PeerFailure,
    ProtocolError,
    UcxCommError,
)
from ..tags import CONN_HELLO, conn_tag
from ..transport.base import FULL_MASK
from ..transport.worker import Worker
from .connection import Connection, drop_unreceived

__all__ = ["MAX_HELLO", "MAX_PENDING", "Listener", "connect", "default_worker",
           "host_identity", "listen"]

log = logging.getLogger(__name__)

_workers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Worker] = \
    weakref.WeakKeyDictionary()
_loopback_workers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Worker] = \
    weakref.WeakKeyDictionary()
_conn_ids = itertools.count(1)
#: How often a worker of connections drops what arrived under no live connection's
#: namespace (a peer can address any namespace: UCX matches tags across the worker).
SWEEP_S = 2.0

#: Connections a listener lets be in their handshake at once; more are closed at once.
MAX_PENDING = 64
#: Largest hello (host identity and worker address) either side accepts.
MAX_HELLO = 1 << 16
_MAGIC = b"UCXc"
_VERSION = 1
_NONCE = 32
_MAC = 32
_F_TOKEN = 1  # opening flag: this side authenticates with a token
# client -> listener: magic, version, flags, nonce
_OPEN = struct.Struct(f"<4sBB2x{_NONCE}s")
# listener -> client: magic, version, flags, nonce, proof (zeros without a token)
_ANSWER = struct.Struct(f"<4sBB2x{_NONCE}s{_MAC}s")
_VERDICT_OK, _VERDICT_BAD = b"\x00", b"\x01"
_HELLO_HEAD = struct.Struct("<IIHI")  # length of the rest, namespace, identity, address


def default_worker() -> Worker:
    """The worker ``listen``/``connect`` use on the running event loop for peers beyond
    loopback (created lazily; released when the loop's tasks are cancelled at shutdown,
    e.g. by ``asyncio.run``). Use it for memory regions; it carries connections' tags
    only (what arrives under no live connection's namespace is dropped): give raw
    endpoints (``Worker.connect``) a worker of their own."""
    return _worker(False)


def _worker(loopback: bool) -> Worker:
    """The running loop's worker for connections beyond loopback, or for loopback
    ones: its UCX TCP transport listens on ``lo`` only (``UCX_NET_DEVICES=lo``, unless
    ``UCX_NET_DEVICES``/``UCXCOMM_DEVICES`` say otherwise), so that a loopback listener
    exposes no UCX port to the network either."""
    loop = asyncio.get_running_loop()
    table = _loopback_workers if loopback else _workers
    worker = table.get(loop)
    if worker is None or worker.closed:
        config = None
        if loopback and not {"UCX_NET_DEVICES", "UCXCOMM_DEVICES"} & set(os.environ):
            config = {"NET_DEVICES": "lo"}
        worker = table[loop] = Worker(config)
    return worker


def _check_port(port: Any, lowest: int, what: str) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not lowest <= port <= 65535:
        raise ValueError(f"{what}: port must be an int in [{lowest}, 65535], got {port!r}")


def _check_token(token: Any, what: str) -> bytes | None:
    """The token as bytes (None: no token)."""
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, (bytes, bytearray)) or not token:
        raise ValueError(f"{what}: token must be a non-empty str or bytes, got "
                         f"{type(token).__name__}")
    return bytes(token)


# This process's client sockets in their handshake and its listeners' ports: a peer
# may present one of this process's own worker addresses only from there.
_our_clients: set[Any] = set()
_our_ports: set[int] = set()


class _Connections:
    """What a worker's connections share: the namespaces ever handed out (never
    reused), those of live connections, and the sweep of what arrives for no live
    namespace."""

    def __init__(self, worker: Worker, sweep: bool) -> None:
        self.worker = worker
        self.taken: set[int] = set()
        self.live: set[int] = set()
        self.sweep = sweep
        self.sweeping = False

    def new_namespace(self) -> int:
        while True:
            ns = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
            if ns and ns not in self.taken:
                self.taken.add(ns)
                self.live.add(ns)
                return ns

    def ended(self, ep: Connection) -> None:
        self.live.discard(ep._recv_ns)  # type: ignore[arg-type]

    def start_sweeps(self) -> None:
        if self.sweep and not self.sweeping:
            self.sweeping = True
            asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        worker = self.worker
        if worker.closed:
            return
        dropped = drop_unreceived(worker, self.live)
        if dropped:
            log.info("dropped %d messages addressed to no live connection", dropped)
        asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)


_registries: weakref.WeakKeyDictionary[Worker, _Connections] = weakref.WeakKeyDictionary()


def _connections(worker: Worker) -> _Connections:
    reg = _registries.get(worker)
    if reg is None:
        # Only our own workers are swept (a worker passed in by the caller carries only
        # connections too, Worker.carry sees to that, but what else it is for is the
        # caller's).
        own = worker in _workers.values() or worker in _loopback_workers.values()
        reg = _registries[worker] = _Connections(worker, own)
    return reg


class _Session:
    """One side's view of a handshake: nonces and, with a token, the keys."""

    def __init__(self, token: bytes | None, client_nonce: bytes, server_nonce: bytes):
        self.token = token
        self.nonces = client_nonce + server_nonce
        self.key = None if token is None else \
            hmac.new(token, b"ucxcomm session" + self.nonces, hashlib.sha256).digest()

    def proof(self, side: bytes) -> bytes:
        """What ``side`` (b"listener" or b"client") sends to prove it holds the token."""
        assert self.token is not None
        return hmac.new(self.token, b"ucxcomm proof " + side + self.nonces,
                        hashlib.sha256).digest()

    def mac(self, side: bytes, body: bytes) -> bytes:
        if self.key is None:
            return b""
        return hmac.new(self.key, side + body, hashlib.sha256).digest()


class _Hello:
    __slots__ = ("address", "identity", "namespace")

    def __init__(self, namespace: int, identity: bytes, address: bytes) -> None:
        self.namespace, self.identity, self.address = namespace, identity, address


def _pack_hello(session: _Session, side: bytes, hello: _Hello) -> bytes:
    rest = struct.pack("<IHI", hello.namespace, len(hello.identity), len(hello.address)) \
        + hello.identity + hello.address
    rest += session.mac(side, rest)
    return struct.pack("<I", len(rest)) + rest


async def _read_hello(reader: asyncio.StreamReader, session: _Session,
                      side: bytes) -> _Hello:
    """The peer's hello, checked (sizes, MAC) before anything in it is used.

    Raises
    ------
    ProtocolError
        Malformed or with a wrong MAC.
    """
    (n,) = struct.unpack("<I", await reader.readexactly(4))
    mac_len = 0 if session.key is None else _MAC
    fixed = struct.calcsize("<IHI")
    if not fixed + mac_len <= n <= MAX_HELLO:
        raise ProtocolError(f"a hello of {n} bytes")
    rest = await reader.readexactly(n)
    ns, hlen, alen = struct.unpack_from("<IHI", rest)
    if fixed + hlen + alen + mac_len != n or not ns or ns > 0x7FFFFFFF:
        raise ProtocolError(f"a malformed hello (namespace {ns:#x}, {hlen} + {alen} "
                            f"bytes in {n})")
    body, mac = rest[:n - mac_len], rest[n - mac_len:]
    if mac_len and not hmac.compare_digest(mac, session.mac(side, body)):
        raise ProtocolError("a hello whose MAC is wrong (tampered with on the way?)")
    return _Hello(ns, body[fixed:fixed + hlen], body[fixed + hlen:])


class _RateLimited:
    """A log line at most once per ``interval`` seconds (the rest counted)."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval, self.last, self.skipped = interval, 0.0, 0

    def __call__(self, level: int, msg: str, *args: Any) -> None:
        if not log.isEnabledFor(level):
            return
        now = time.monotonic()
        if now - self.last < self.interval:
            self.skipped += 1
            return
        if self.skipped:
            msg += f" ({self.skipped} more like it not logged)"
            self.skipped = 0
        self.last = now
        log.log(level, msg, *args)


_auth_log = _RateLimited()  # wrong or missing tokens (warnings)
_drop_log = _RateLimited()  # other failed handshakes (info)


async def _establish(worker: Worker, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter, session: _Session, *, listener: bool,
                     trusted: bool) -> Connection:
    """Hellos, worker-address checks, the UCX endpoint and its wire-up check: the
    connected :class:`Connection` (the caller bounds the time)."""
    mine, theirs = (b"listener", b"client") if listener else (b"client", b"listener")
    reg = _connections(worker)
    ns = reg.new_namespace()  # (never reused, even if this handshake fails)
    ep = None
    try:
        own = _Hello(ns, host_identity(), worker.address)
        if not listener:  # the client speaks first; the listener answers a good hello
            writer.write(_pack_hello(session, mine, own))
        peer = await _read_hello(reader, session, theirs)
        try:
            itself = worker.check_peer_address(peer.address)
        except ValueError as exc:
            raise ProtocolError(f"the peer's UCX worker address is unusable: {exc}"
                                ) from None
        if itself and not _from_this_process(writer, listener):
            # (a connection from us to us is fine; another process presenting our own
            # address would make us send to ourselves, into any namespace it names)
            raise ProtocolError("the peer presented this process's own worker address")
        if listener:
            writer.write(_pack_hello(session, mine, own))
        same_host = bool(own.identity) and peer.identity == own.identity
        label = ("connection", next(_conn_ids))
        ucx_ep = worker.raw_endpoint(peer.address, error_handling=not same_host)
        ep = worker.adopt(ucx_ep, label, Connection)
    finally:
        if ep is None:
            reg.live.discard(ns)
    ep._connected(ns, peer.namespace, trusted, reader, writer, reg.ended)
    reg.start_sweeps()
    try:
        # One message each way on the path that will carry the traffic.
        check = bytearray(1)
        got: Any = worker.recv_into(worker.recv_ptr(check), conn_tag(ns, CONN_HELLO),
                                    FULL_MASK, ep._peers)
        sent = ep.isend(b"\x01", conn_tag(peer.namespace, CONN_HELLO))
        pending = [f for f in (sent, got if type(got) is not tuple else None)
                   if f is not None]
        if pending:
            worker.wake()
            results = await asyncio.gather(*pending, return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException):
                    raise res
    except BaseException:
        ep.abort()
        raise
    return ep


def _from_this_process(writer: asyncio.StreamWriter, listener: bool) -> bool:
    """Whether the other end of the handshake's TCP connection is this process: for a
    listener, one of our clients' sockets; for a client, one of our listeners' ports on
    a loopback address."""
    peer = writer.get_extra_info("peername")
    if listener:
        return peer in _our_clients
    return peer is not None and peer[1] in _our_ports and is_loopback(str(peer[0]))


class Listener:
    """Accepts connections and runs ``handler(endpoint)`` for each, as a task.

    Use :func:`listen` to create one. ``port`` is the bound port; ``await close()``
    (or leaving ``async with``) stops accepting and releases the port at once:
    established connections stay open.
    """

    def __init__(self, worker: Worker, handler: Callable[[Connection], Awaitable[Any]],
                 token: bytes | None, timeout: float | None) -> None:
        self._worker = worker
        self._handler = handler
        self._token = token
        self._timeout = timeout
        self._tasks: set[asyncio.Task] = set()
        self._pending = 0
        self._closed = False
        self._server: asyncio.base_events.Server | None = None
        self._port = 0
        self._ip = ""

    async def _start(self, host: str, port: int) -> Listener:
        try:
            self._server = await asyncio.start_server(self._on_client, host, port,
                                                      reuse_address=True, backlog=128)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UcxCommError(f"port {port} is in use on {host}") from None
            raise UcxCommError(f"cannot listen on {host}:{port}: {exc}") from None
        sockname = self._server.sockets[0].getsockname()
        self._ip, self._port = str(sockname[0]), int(sockname[1])
        _our_ports.add(self._port)
        return self

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    @property
    def ip(self) -> str:
        """The bound address."""
        return self._ip

    @property
    def closed(self) -> bool:
        return self._closed

    async def _on_client(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self._closed or self._pending >= MAX_PENDING:
            log.debug("listener: turned %s away (%s)", peer,
                      "closed" if self._closed else "too many handshakes")
            writer.close()
            return
        self._pending += 1
        ep = None
        try:
            async with asyncio.timeout(self._timeout):
                ep = await self._accept(reader, writer, peer)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            log.debug("listener: dropped %s during its handshake (%s)", peer,
                      type(exc).__name__)
        except AuthenticationError as exc:
            _auth_log(logging.WARNING, "listener on port %d: refused a client from %s: %s",
                      self._port, peer, exc)
        except (ProtocolError, PeerFailure, UcxCommError) as exc:
            _drop_log(logging.INFO, "listener on port %d: dropped a client from %s: %s",
                      self._port, peer, exc)
        except asyncio.CancelledError:
            # The process is shutting down (asyncio.run cancels what is left). This is
            # the top of the connection's task, with nobody above to tell: end
            # quietly (Python 3.11's stream server logs a traceback for a re-raise).
            pass
        finally:
            self._pending -= 1
            if ep is None:
                writer.close()
        if ep is None:
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._handler(ep)
        except asyncio.CancelledError:  # (the top of the task, as above)
            ep.abort()
        except PeerFailure as exc:  # the peer left or broke the protocol: not a bug here
            ep.abort()
            log.debug("listener: connection %s ended its handler: %s", ep._label(), exc)
        except Exception:
            ep.abort()
            log.exception("listener: the connection handler raised")
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      peer: Any) -> Connection:
        magic, version, flags, client_nonce = _OPEN.unpack(
            await reader.readexactly(_OPEN.size))
        if magic != _MAGIC or version != _VERSION:
            raise ProtocolError("not a ucxcomm client")
        token = self._token
        server_nonce = secrets.token_bytes(_NONCE)
        session = _Session(token, client_nonce, server_nonce)
        proof = session.proof(b"listener") if token is not None else bytes(_MAC)
        writer.write(_ANSWER.pack(_MAGIC, _VERSION, _F_TOKEN if token else 0,
                                  server_nonce, proof))
        if token is not None:
            if not flags & _F_TOKEN:
                raise AuthenticationError("the client has no token")
            try:
                theirs = await reader.readexactly(_MAC)
            except asyncio.IncompleteReadError:
                raise AuthenticationError("the client left during the challenge (its "
                                          "token differs from ours?)") from None
            if not hmac.compare_digest(theirs, session.proof(b"client")):
                writer.write(_VERDICT_BAD)
                raise AuthenticationError("wrong token")
            writer.write(_VERDICT_OK)
        elif flags & _F_TOKEN:
            raise AuthenticationError("the client has a token and this listener none "
                                      "(the client refuses it)")
        return await _establish(self._worker, reader, writer, session, listener=True,
                                trusted=token is not None)

    def abort(self) -> None:
        """Stop accepting new connections at once (idempotent); the port is released."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
            _our_ports.discard(self._port)

    async def close(self) -> None:
        """Stop accepting new connections (idempotent); connections in their handshake
        finish it."""
        self.abort()

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def listen(handler: Callable[[Connection], Awaitable[Any]], port: int = 0, *,
                 host: str = "127.0.0.1", token: str | bytes | None = None,
                 insecure: bool = False, worker: Worker | None = None,
                 timeout: float | None = 10.0) -> Listener:
    """Accept connections on ``host:port`` (port 0: any free port, see
    ``listener.port``).

    ``handler(ep)`` is a coroutine function, run as a task for each new connection once
    its handshake succeeded.

    When the handler returns, the endpoint stays open (close it, or keep it for later);
    it is released anyway a second after its peer leaves. When the handler raises, the
    endpoint is closed (a ``PeerFailure``, the peer leaving or breaking the protocol, is
    logged at debug level; anything else with its traceback).

    Parameters
    ----------
    host : str
        The address to bind: loopback by default. A listener reachable from other hosts
        (``"0.0.0.0"``, ``"::"``, an interface's address or name) needs ``token=`` or
        ``insecure=True``.
    token : str or bytes, optional
        A secret shared with the clients (random, 128 bits or more: the handshake lets a
        client test guesses offline): each connection starts with a mutual
        challenge-response (HMAC-SHA256), and only clients holding it get to the handler.
        Objects on authenticated connections use pickle by default.
    insecure : bool
        Allow a listener beyond loopback without a token (anyone who reaches the port can
        connect; objects then use the safe codec by default).
    timeout : float or None
        The most a connection's handshake may take (default 10 s); at most
        :data:`MAX_PENDING` handshakes run at once.

    Raises
    ------
    ValueError
        Bad ``port``, ``timeout`` or ``token``; a non-loopback ``host`` without
        ``token`` or ``insecure=True``; a ``worker`` that carries a communicator
        (``ucxcomm.init``'s: connections need a worker of their own, see
        ``Worker.carry``) (before anything binds).
    TypeError
        ``host`` is not a non-empty string.
    UcxCommError
        The port cannot be bound ("port P is in use").
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"listen: host must be a non-empty str, got {host!r}")
    _check_port(port, 0, "listen")
    check_timeout(timeout, "listen", zero=False)
    secret = _check_token(token, "listen")
    if secret is None and not insecure and not is_loopback(host):
        raise ValueError(f"listen: host={host!r} is reachable from other hosts; pass "
                         "token= (a secret the clients share) or insecure=True to accept "
                         "anyone who can reach the port")
    worker = worker or _worker(is_loopback(host))
    worker.carry("connections")  # (ValueError for a communicator's worker)
    listener = Listener(worker, handler, secret, timeout)
    # ("localhost" would bind 127.0.0.1 and ::1, on two different ports when port=0)
    return await listener._start("127.0.0.1" if host == "localhost" else host, port)


async def connect(host: str, port: int, *, token: str | bytes | None = None,
                  worker: Worker | None = None, timeout: float | None = 30.0) -> Connection:
    """Connect to a :func:`listen`-ing peer at ``host:port``.

    With ``token``, both sides prove they hold it before anything else is exchanged;
    without, the listener must have none either.

    Raises
    ------
    TypeError, ValueError
        ``host`` is not a non-empty string, ``port`` not in [1, 65535], a bad
        ``timeout`` or ``token``, a ``worker`` that carries a communicator (before any
        I/O).
    AuthenticationError
        The listener wants a token and ours is missing or different, or we have a token
        and the listener none.
    CommTimeoutError
        Not established within ``timeout`` seconds.
    PeerFailure
        Nothing accepted the connection (refused: nobody listens there, or a listener
        that was closed), the host is unreachable, or the listener dropped us.
    ProtocolError
        The listener answered with something that is not our protocol.
    UcxCommError
        ``host`` is not a valid address or resolvable name.
    ClosedError
        ``worker`` is closed.
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"connect: host must be a non-empty str, got {host!r}")
    _check_port(port, 1, "connect")
    check_timeout(timeout, "connect", zero=False)
    secret = _check_token(token, "connect")
    worker = worker or _worker(is_loopback(host))
    if worker.closed:
        raise ClosedError("the worker is closed")
    worker.carry("connections")  # (ValueError for a communicator's worker)
    writer = None
    ep = None
    try:
        async with limit(timeout, "connect", message=f"connecting to {host}:{port} took "
                         f"longer than {timeout or 0:g} s"):
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except socket.gaierror as exc:
                raise UcxCommError(f"cannot connect to {host}:{port}: {host!r} is not a "
                                   f"valid address or resolvable name ({exc})") from None
            except OSError as exc:
                raise PeerFailure(f"cannot connect to {host}:{port}: refused or "
                                  f"unreachable (nothing listening there?): {exc}") from None
            ep = await _client_handshake(worker, reader, writer, secret, host, port)
    except asyncio.IncompleteReadError:
        raise PeerFailure(f"the listener at {host}:{port} closed the connection during "
                          "the handshake") from None
    except ConnectionError as exc:
        raise PeerFailure(f"the connection to {host}:{port} broke during the handshake: "
                          f"{exc}") from None
    finally:
        if ep is None and writer is not None:
            writer.close()
    return ep


async def _client_handshake(worker: Worker, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter, secret: bytes | None, host: str,
                            port: int) -> Connection:
    where = f"{host}:{port}"
    me = writer.get_extra_info("sockname")
    _our_clients.add(me)
    try:
        return await _client_exchange(worker, reader, writer, secret, where)
    finally:
        _our_clients.discard(me)


async def _client_exchange(worker: Worker, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter, secret: bytes | None,
                           where: str) -> Connection:
    client_nonce = secrets.token_bytes(_NONCE)
    writer.write(_OPEN.pack(_MAGIC, _VERSION, _F_TOKEN if secret else 0, client_nonce))
    magic, version, flags, server_nonce, proof = _ANSWER.unpack(
        await reader.readexactly(_ANSWER.size))
    if magic != _MAGIC:
        raise ProtocolError(f"{where} is not a ucxcomm listener")
    if version != _VERSION:
        raise ProtocolError(f"the listener at {where} speaks version {version}, we "
                            f"{_VERSION}")
    session = _Session(secret, client_nonce, server_nonce)
    if flags & _F_TOKEN and secret is None:
        raise AuthenticationError(f"the listener at {where} requires a token (pass "
                                  "token=)")
    if secret is not None:
        if not flags & _F_TOKEN:
            raise AuthenticationError(f"the listener at {where} has no token: it does not "
                                      "authenticate (connect without token= to accept "
                                      "that)")
        if not hmac.compare_digest(proof, session.proof(b"listener")):
            raise AuthenticationError(f"the listener at {where} holds another token")
        writer.write(session.proof(b"client"))
        try:
            verdict = await reader.readexactly(1)
        except asyncio.IncompleteReadError:
            verdict = _VERDICT_BAD
        if verdict != _VERDICT_OK:
            raise AuthenticationError(f"the listener at {where} refused our token")
    return await _establish(worker, reader, writer, session, listener=False,
                            trusted=secret is not None)


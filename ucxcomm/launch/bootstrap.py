"""Forming the world: rank/size discovery from launchers, address exchange, ``init()``.

Rank and size come from the first match of (DESIGN.md section 6):

1. explicit ``init(rank=, size=, store=)``;
2. ``ucxcomm run``: ``UCXCOMM_RANK``, ``UCXCOMM_SIZE``, ``UCXCOMM_STORE`` (launcher-hosted);
3. torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (our store listens
   on ``MASTER_PORT + 1`` on rank 0, since torchrun's own store holds ``MASTER_PORT``);
4. Slurm: ``SLURM_PROCID``, ``SLURM_NTASKS``, first host of ``SLURM_NODELIST``; port
   ``UCXCOMM_PORT`` or ``20000 + (job id * 16 + step id) % 20000``;
5. Open MPI: ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``;
6. MPICH/PMI: ``PMI_RANK``/``PMI_SIZE``.

For 5 and 6 the store address is ``UCXCOMM_STORE`` or ``MASTER_ADDR``/``MASTER_PORT``; when
all ranks are on one host, rank 0 hosts it on 127.0.0.1 at a port derived from the
launcher's per-host daemon (the ranks' common parent process).
No match at all: a singleton world of size 1. ``UCXCOMM_TOKEN`` is the job's shared
secret for the store (``ucxcomm run`` makes a random one).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import os
import re
import signal
import socket
import zlib
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

from .. import settings
from .._deadline import Deadline, check_timeout
from ..comm import Comm, World, elastic
from ..errors import BootstrapError, CommTimeoutError
from ..tags import MAX_RANKS
from .store import FAILOVER_GRACE_S, StoreClient, StoreServer

__all__ = ["WorldSpec", "detect", "finalize", "init", "parse_nodelist", "watch_peers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldSpec:
    """Where this process stands: rank, size and how to reach the bootstrap store."""

    rank: int
    size: int
    host: str | None  # store host (None for a singleton)
    port: int | None
    token: str
    host_store: bool  # this process serves the store (rank 0 under most launchers)
    source: str  # which convention matched ("explicit", "ucxcomm", "torchrun", ...)
    guessable: bool = False  # the token is derived from launcher variables, not secret
    restart: int = 0  # a replacement's restart count: it joins the running job (grow)


def _setting(env: Mapping[str, str], name: str) -> Any:
    """A ``UCXCOMM_*`` launch setting (:mod:`ucxcomm.settings`); malformed values are
    bootstrap errors naming the variable."""
    try:
        return settings.get(name, env)
    except ValueError as exc:
        raise BootstrapError(str(exc)) from None


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise BootstrapError(f"{name}={value!r} is not an integer") from None


def _require(env: Mapping[str, str], names: tuple[str, ...], convention: str) -> None:
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise BootstrapError(f"{convention} launch detected but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not set")


def _hostport(value: str, name: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BootstrapError(f"{name}={value!r} is not host:port")
    return host.strip("[]"), int(port)


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``"gpu[01-03,7],cpu5"``) into host names."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        stem, ranges = m.group(1), m.group(2)
        if not ranges:
            hosts.append(stem)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(stem + lo)
                continue
            width = len(lo)
            hosts.extend(f"{stem}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
    return hosts


def _derived_port(key: str) -> int:
    return 20000 + zlib.crc32(key.encode()) % 20000


def _mpi_store(env: Mapping[str, str], convention: str, local_size_var: str,
               size: int) -> tuple[str, int]:
    store = _setting(env, "UCXCOMM_STORE")
    if store:
        return _hostport(store, "UCXCOMM_STORE")
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], _int_var(env, "MASTER_PORT")
    local = env.get(local_size_var)
    if local is not None and local.isdigit() and int(local) == size:
        port = (_setting(env, "UCXCOMM_PORT")
                or _derived_port(f"{convention}-{os.getppid()}"))
        return "127.0.0.1", port
    raise BootstrapError(
        f"{convention} launch across hosts needs the bootstrap store address: set "
        "UCXCOMM_STORE=host:port (a host every rank can reach; rank 0 serves it) or "
        "MASTER_ADDR and MASTER_PORT")


def detect(env: Mapping[str, str] | None = None, *, rank: int | None = None,
           size: int | None = None, store: str | None = None) -> WorldSpec:
    """Work out rank, size and store from arguments, then launcher variables.

    Raises
    ------
    BootstrapError
        A launcher convention is half present, or a value is malformed; the message
        names what is missing.
    """
    env = os.environ if env is None else env
    token = _setting(env, "UCXCOMM_TOKEN")
    if rank is not None or size is not None or store is not None:
        if rank is None or size is None:
            raise BootstrapError("init(): pass both rank= and size= (and store= when size > 1)")
        if size > 1 and store is None:
            raise BootstrapError("init(rank=, size=) with size > 1 needs store='host:port'")
        host, port = _hostport(store, "store") if store else (None, None)
        return _check(WorldSpec(rank, size, host, port, token or "ucxcomm-explicit",
                                rank == 0 and size > 1, "explicit", not token))
    if "UCXCOMM_RANK" in env or ("UCXCOMM_STORE" in env and "UCXCOMM_SIZE" in env):
        _require(env, ("UCXCOMM_RANK", "UCXCOMM_SIZE", "UCXCOMM_STORE", "UCXCOMM_TOKEN"),
                 "ucxcomm run")
        host, port = _hostport(_setting(env, "UCXCOMM_STORE"), "UCXCOMM_STORE")
        return _check(WorldSpec(_setting(env, "UCXCOMM_RANK"), _setting(env, "UCXCOMM_SIZE"),
                                host, port, token, False, "ucxcomm",
                                restart=_setting(env, "UCXCOMM_RESTART_COUNT")))
    if "RANK" in env and ("WORLD_SIZE" in env or "MASTER_ADDR" in env):
        _require(env, ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), "torchrun")
        port = _setting(env, "UCXCOMM_PORT") or _int_var(env, "MASTER_PORT") + 1
        rank_ = _int_var(env, "RANK")
        tok = token or "torchrun-" + env.get("TORCHELASTIC_RUN_ID", env["MASTER_PORT"])
        restart = _setting(env, "UCXCOMM_RESTART_COUNT")
        return _check(WorldSpec(rank_, _int_var(env, "WORLD_SIZE"), env["MASTER_ADDR"], port,
                                tok, rank_ == 0 and not restart, "torchrun", not token,
                                restart=restart))
    if "SLURM_PROCID" in env:
        _require(env, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODELIST"), "Slurm")
        hosts = parse_nodelist(env["SLURM_NODELIST"])
        if not hosts:
            raise BootstrapError(f"SLURM_NODELIST={env['SLURM_NODELIST']!r} names no host")
        job = env.get("SLURM_JOB_ID", "0")
        step = env.get("SLURM_STEP_ID", "0")
        if _setting(env, "UCXCOMM_PORT"):
            port = _setting(env, "UCXCOMM_PORT")
        else:
            port = 20000 + (int(job) * 16 + int(step)) % 20000 if job.isdigit() and \
                step.isdigit() else _derived_port(f"slurm-{job}.{step}")
        rank_ = _int_var(env, "SLURM_PROCID")
        restart = _setting(env, "UCXCOMM_RESTART_COUNT")
        return _check(WorldSpec(rank_, _int_var(env, "SLURM_NTASKS"), hosts[0], port,
                                token or f"slurm-{job}.{step}", rank_ == 0 and not restart,
                                "slurm", not token, restart=restart))
    for convention, rvar, svar, lvar in (
        ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ):
        if rvar in env:
            _require(env, (rvar, svar), convention)
            rank_, size_ = _int_var(env, rvar), _int_var(env, svar)
            host, port = _mpi_store(env, convention, lvar, size_)
            return _check(WorldSpec(rank_, size_, host, port,
                                    token or f"{convention}-{host}:{port}", rank_ == 0,
                                    convention.lower(), not token))
    return WorldSpec(0, 1, None, None, token, False, "singleton")


def _check(spec: WorldSpec) -> WorldSpec:
    if not 1 <= spec.size <= MAX_RANKS:
        raise BootstrapError(f"world size {spec.size} is out of range (1..{MAX_RANKS})")
    if not 0 <= spec.rank < spec.size:
        raise BootstrapError(f"rank {spec.rank} is out of range for world size {spec.size}")
    return spec


def guessable_token_warning(spec: WorldSpec, bind: str) -> str | None:
    """The warning for a store that listens beyond loopback with a token anyone on the
    network can derive (from ``MASTER_PORT``, the Slurm job id, ...), else None."""
    if not spec.guessable or bind.startswith("127.") or bind == "::1":
        return None
    return (f"the bootstrap store listens on {bind}:{spec.port} and its token is derived "
            f"from the {spec.source} variables, so others who can reach it could guess it "
            "and join; set UCXCOMM_TOKEN to a secret shared by the job's ranks "
            "(docs/security.md)")


def _bind_host(host: str) -> str:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return "0.0.0.0"
    addrs = [str(info[4][0]) for info in infos]
    if all(a.startswith("127.") or a == "::1" for a in addrs):
        return addrs[0]
    return "0.0.0.0"


_world: World | None = None
_lock: asyncio.Lock | None = None
_generation = 0


def _next_generation() -> int:
    global _generation
    _generation += 1
    return _generation


def pack_address(host: bytes, address: bytes) -> bytes:
    """A rank's entry in the store: its host identity (length-prefixed) and worker address."""
    return len(host).to_bytes(2, "little") + host + address


def unpack_address(value: bytes) -> tuple[bytes, bytes]:
    """``(host identity, worker address)`` of a :func:`pack_address` entry."""
    n = int.from_bytes(value[:2], "little")
    return bytes(value[2:2 + n]), bytes(value[2 + n:])


async def _form_world(spec: WorldSpec, timeout: float, config: dict[str, str] | None,
                      policy: Any = None) -> World:
    """The world, formed within ``timeout`` seconds in all (one deadline for every step).

    Raises
    ------
    CommTimeoutError
        The store or a rank's address did not come in time (which step says why).
    """
    deadline = Deadline(timeout, "forming the world", zero=False)
    try:
        return await _form_world_steps(spec, deadline, config, policy)
    except CommTimeoutError as exc:
        if not deadline.passed():
            raise
        raise CommTimeoutError(f"the world did not form within {timeout:g} s "
                               f"(UCXCOMM_TIMEOUT or init(timeout=)): {exc}") from None


async def _form_world_steps(spec: WorldSpec, deadline: Deadline, config: dict[str, str] | None,
                            policy: Any) -> World:
    from .._net import host_identity
    from ..transport import Worker  # keep `import ucxcomm` free of UCX
    from ..transport.config import policy_from, prepare

    # Transport policy first: transport="rdma" without RDMA fails here, before any
    # connection to the store or to peers.
    plan = prepare(policy if policy is not None else policy_from())

    server: StoreServer | None = None
    client: StoreClient | None = None
    if spec.size > 1:
        assert spec.host is not None and spec.port is not None
        if spec.host_store:
            bind = _bind_host(spec.host)
            warning = guessable_token_warning(spec, bind)
            if warning:
                log.warning(warning)
            server = await StoreServer(spec.token, bind, spec.port, fence=True).start()
            server.host_rank = spec.rank
        try:
            client = await StoreClient.connect(spec.host, spec.port, spec.token,
                                              deadline.left() or 0.0)
        except BaseException:
            if server is not None:
                await server.close()
            raise
    worker = Worker(config, plan=plan)
    hosts: list[bytes] | None = None
    world_closers: list[Any] = []
    if client is not None and spec.restart > 0:
        return await _join_running(spec, deadline, worker, client)
    try:
        if client is None:
            addresses = [worker.address]
        else:
            # Keys are per world generation: a job may finalize and init again (every
            # rank the same number of times), and the launcher's store outlives worlds.
            # Each value: this rank's host identity, then its worker address.
            gen = _next_generation()
            # Collective fingerprints on or off: the same on every rank (a rank with them
            # would wait for a fingerprint another never sends), checked against rank 0.
            check = b"1" if settings.get("UCXCOMM_CHECK_COLLECTIVES") else b"0"
            if spec.rank == 0:
                await client.set(f"w{gen}/check", check, deadline.left())
            if spec.rank == 1 and spec.source != "ucxcomm":
                # Rank 0 hosts the store: rank 1 keeps a standby of it (before its own
                # address, so that every rank reads it in the exchange below).
                standby = await _start_standby(spec, client, deadline)
                world_closers.append(standby)
            await client.set(f"w{gen}/addr/{spec.rank}",
                             pack_address(host_identity(), worker.address), deadline.left())
            entries = [unpack_address(await client.get(f"w{gen}/addr/{r}", deadline.left()))
                       for r in range(spec.size)]
            if spec.rank != 0 and await client.get(f"w{gen}/check", deadline.left()) != check:
                raise BootstrapError(
                    f"UCXCOMM_CHECK_COLLECTIVES is {'on' if check == b'1' else 'off'} on rank "
                    f"{spec.rank} and {'off' if check == b'1' else 'on'} on rank 0: it must be "
                    "the same on every rank")
            hosts = [h for h, _ in entries]
            addresses = [a for _, a in entries]
            if spec.source != "ucxcomm" and spec.size > 1:
                where = (await client.get(f"w{gen}/standby", deadline.left())).decode()
                host_, _, port_ = where.rpartition(":")
                client.standby = (host_, int(port_))
    except BaseException:
        worker.abort()
        for closer in world_closers:
            await closer()
        if client is not None:
            await client.close()
        if server is not None:
            await server.close()
        raise
    world = World(worker, spec.rank, spec.size, addresses, hosts)
    world.closers.extend(world_closers)
    if spec.source == "ucxcomm":
        _install_task_dump(spec.rank)
    if client is not None:
        await watch_peers(world, client, server,
                          host_rank=0 if not spec.source == "ucxcomm" else None,
                          timeout=deadline.left() or 0.0)
        if spec.source != "ucxcomm":
            keep_standby_when_asked(world, client, spec)
        assert spec.host is not None and spec.port is not None
        from .status import serve

        serve(world, spec.host, spec.port, spec.token)  # (ucxcomm status --store)
    log.debug("rank %d/%d: world formed via %s", spec.rank, spec.size, spec.source)
    return world


async def _start_standby(spec: WorldSpec, client: StoreClient, deadline: Deadline) -> Any:
    """(Rank 1, where rank 0 hosts the store.) A standby store that follows rank 0's
    and takes over when it goes (launch/store.py, "Standby"); its address published
    under ``w<gen>/standby``. Returns what closes it."""
    assert spec.host is not None and spec.port is not None
    close, where = await start_standby(spec.token, client, spec.rank, 0,
                                       (spec.host, spec.port), deadline.left())
    try:
        await client.set(f"w{_generation}/standby", where.encode(), deadline.left())
    except BaseException:
        await close()
        raise
    return close


async def start_standby(token: str, client: StoreClient, rank: int, primary_rank: int,
                        also: tuple[str, int] | None, timeout: float | None
                        ) -> tuple[Callable[[], Awaitable[None]], str]:
    """A standby of the store ``client`` is connected to (hosted by ``primary_rank``),
    served by this process (``rank``), at the address the store sees ``client`` from:
    it takes over when the link to the store drops (``also``: the job's first store
    address, listened on too where this host can). Returns ``(close, "host:port")``."""
    sock = client._writer.get_extra_info("sockname")
    mine = sock[0] if sock else "127.0.0.1"  # (the address the primary sees us from)
    standby = await StoreServer(token, mine, 0, fence=True).start()
    standby.host_rank = rank
    host, _, port = client.address.rpartition(":")
    try:
        follower = await StoreClient.connect(host, int(port), token, timeout or 0.0)
    except BaseException:
        await standby.close()
        raise

    def lost(closing: bool) -> None:
        if not closing:  # (the primary's host rank died: serve)
            standby.take_over(primary_rank, FAILOVER_GRACE_S, also=also,
                              silent=follower.lost_silently)

    follower.on_lost = lost
    where = f"{mine}:{standby.port}"
    try:
        await follower.replicate(standby.load, standby.apply, timeout, rank=rank,
                                 address=where)
    except BaseException:
        await follower.close()
        await standby.close()
        raise

    async def close() -> None:
        await follower.leave(timeout=2.0)  # (a standby that leaves is not replaced)
        await follower.close()
        await standby.close()

    return close, where


def keep_standby_when_asked(world: World, client: StoreClient, spec: WorldSpec) -> None:
    """Start a standby when the store asks this rank to (its standby died, or a standby
    took over: launch/store.py, "Standby"); closed with ``world``."""
    tasks: set[asyncio.Task] = set()

    def wanted(primary_rank: int) -> None:
        if world.closed or tasks:
            return

        async def start() -> None:
            try:
                close, where = await start_standby(
                    spec.token, client, world.rank, primary_rank,
                    None if spec.host is None or spec.port is None else (spec.host, spec.port),
                    10.0)
            except Exception as exc:  # (the store asks again only after a change)
                log.warning("rank %d: could not start a standby store (%s)", world.rank, exc)
                return
            log.info("rank %d: keeps the standby store at %s", world.rank, where)
            world.closers.insert(0, close)

        task = asyncio.get_running_loop().create_task(start())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    client.on_standby_wanted = wanted


async def _join_running(spec: WorldSpec, deadline: Deadline, worker: Any,
                        client: StoreClient) -> World:
    """A replacement's world (``UCXCOMM_RESTART_COUNT`` > 0): join the store as this
    rank (its liveness watch, first: a joiner that dies is seen to), write a joiner's
    entry, wait until a ``Comm.grow`` of the running job admits it, and make the world
    whose communicator is the one it was admitted to (comm/elastic.py)."""
    from .._net import host_identity

    deaths: list[tuple[int, bool, int | None]] = []
    try:
        client.on_dead = lambda r, quiet, life: deaths.append((r, quiet, life))
        await client.join(spec.rank, deadline.left())
        life = client.life
        n = await client.add("joiners", 1, deadline.left()) - 1
        entry = json.dumps({"rank": spec.rank, "life": life,
                            "address": base64.b64encode(worker.address).decode(),
                            "host": base64.b64encode(host_identity()).decode()})
        await client.set(elastic.JOINER_KEY.format(n), entry.encode(), deadline.left())
        log.info("rank %d (restart %d): waiting for the running job to admit it (grow)",
                 spec.rank, spec.restart)
        raw = await client.get(elastic.ADMIT_KEY.format(spec.rank, life), deadline.left())
        try:
            rec = elastic.admission(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise BootstrapError(f"rank {spec.rank}: a malformed admission ({exc})") from None
        if spec.rank not in rec["members"]:
            raise BootstrapError(f"rank {spec.rank}: admitted to a communicator without it")
        if rec["check"] != bool(settings.get("UCXCOMM_CHECK_COLLECTIVES")):
            raise BootstrapError("UCXCOMM_CHECK_COLLECTIVES differs from the running job's: "
                                 "it must be the same on every rank")
    except BaseException:
        worker.abort()
        await client.close()
        raise
    size = max(max(rec["members"]) + 1, spec.size)
    addresses = [rec["addresses"].get(r, b"") for r in range(size)]
    hosts = [rec["hosts"].get(r, b"") for r in range(size)]
    world = World(worker, spec.rank, size, addresses, hosts, members=rec["members"],
                  cid=rec["cid"], lives=rec["lives"])
    world.joined_cursor = rec["cursor"]
    world.comm._group.origin_size = len(rec["members"])
    if spec.source == "ucxcomm":
        _install_task_dump(spec.rank)
    await watch_peers(world, client, None, host_rank=None, timeout=deadline.left() or 0.0,
                      joined=True)
    if spec.source != "ucxcomm":
        keep_standby_when_asked(world, client, spec)
    for r, quiet, life_ in deaths:  # (deaths reported while it waited)
        world.peer_failed(r, quiet, life_)
    assert spec.host is not None and spec.port is not None
    from .status import serve

    serve(world, spec.host, spec.port, spec.token)
    log.debug("rank %d: joined the running job as rank %d of %d", spec.rank,
              world.comm.rank, world.comm.size)
    return world


async def watch_peers(world: World, client: StoreClient, server: StoreServer | None, *,
                      host_rank: int | None, timeout: float, joined: bool = False) -> None:
    """Make ``client``'s store connection ``world``'s liveness watch.

    Joins the store as ``world.rank``: when another joined rank drops without leaving,
    what waits on it fails with ``PeerFailure``. ``host_rank`` is the rank whose process
    serves the store (None: the launcher does); losing the store means that rank died.
    Closing the world leaves the store, and a hosting rank (``server``) serves it until
    the others have left too (bounded), then closes it. ``joined``: the client joined
    already (a replacement joins before it is admitted).
    """
    rank, size = world.rank, world.size
    client.on_dead = world.peer_failed
    world.store = client  # (agree/shrink/revoke: comm/elastic.py)
    client.on_notice = functools.partial(elastic.notice_received, world)

    def lost(closing: bool) -> None:
        if world.closed:
            return
        if host_rank is not None and rank != host_rank:
            world.peer_failed(host_rank, quiet=closing)  # (its store shut down)
            # Nobody can report a death to this rank any more: the deaths the store had
            # not relayed yet were lost with it (in the fault suite rank 0 saw a victim
            # die first and quit before telling the others, who then waited forever on
            # the victim), so every peer is failed, quietly.
            world.watch_lost(f"the bootstrap store on rank {host_rank}, which reported "
                             "deaths, is gone; this peer's failure could no longer be "
                             "detected")
        else:
            log.warning("rank %d: lost the bootstrap store (launcher gone?)", rank)
            for r in range(size):
                world.peer_failed(r)

    client.on_lost = lost
    if not joined:
        await client.join(rank, timeout)
    for r, life in client.dead_lives:
        world.peer_failed(r, life=life)

    async def leave() -> None:
        await client.leave()
        if server is not None:
            # Serve until the other ranks have left too (bounded).
            await server.wait_until_gone(size, timeout=10.0)
        await client.close()
        if server is not None:
            await server.close()

    world.closers.append(leave)


def _install_task_dump(rank: int) -> None:
    """Under ``ucxcomm run``: SIGUSR1 logs every asyncio task's stack (the launcher sends
    it to the ranks that joined before dumping thread stacks on ``--timeout``)."""
    loop = asyncio.get_running_loop()

    def dump() -> None:
        import io

        out = io.StringIO()
        for task in asyncio.all_tasks(loop):
            out.write(f"--- task {task.get_name()}\n")
            task.print_stack(file=out)
        log.warning("rank %d: asyncio tasks at SIGUSR1:\n%s", rank, out.getvalue())

    try:
        loop.add_signal_handler(signal.SIGUSR1, dump)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
        log.debug("cannot install the SIGUSR1 task dump")


class _Init:
    """What :func:`init` returns: awaitable, and an async context manager."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self._kwargs = kwargs
        self._comm: Comm | None = None

    def __await__(self) -> Generator[Any, None, Comm]:
        return _init(**self._kwargs).__await__()

    async def __aenter__(self) -> Comm:
        self._comm = await _init(**self._kwargs)
        return self._comm

    async def __aexit__(self, et: Any, exc: Any, tb: Any) -> None:
        assert self._comm is not None
        if et is None:
            await finalize()
        else:
            _abort()


def init(*, rank: int | None = None, size: int | None = None, store: str | None = None,
         timeout: float | None = None, ucx_config: dict[str, str] | None = None,
         transport: str | None = None, tag_offload: Any = None,
         devices: Any = None) -> _Init:
    """Join the world and return its communicator (``comm.rank``, ``comm.size``).

    ``await ucxcomm.init()`` or ``async with ucxcomm.init() as comm``. Idempotent: a
    second call returns the same communicator.

    Parameters
    ----------
    rank, size, store : optional
        Explicit placement (``store="host:port"``; rank 0 serves it). Otherwise read
        from the launcher's environment (module docstring); no launcher: size 1.
    timeout : float, optional
        Deadline for the bootstrap (``UCXCOMM_TIMEOUT``, default 120 s).
    ucx_config : dict, optional
        Extra UCX context options (``{"TLS": "tcp,self"}``); ``UCX_*`` variables win.
    transport : {"auto", "rdma", "tcp"}, optional
        ``UCXCOMM_TRANSPORT``, default ``"auto"``: RDMA when an active RDMA port and a
        verbs-capable UCX are present, else TCP (plus shared memory on one host).
        ``"rdma"`` fails at once when RDMA is unavailable, and a peer reachable only
        without RDMA fails with ``PeerFailure``. ``"tcp"``: never RDMA.
        See docs/transports.md.
    tag_offload : "auto", True or False, optional
        ``UCXCOMM_TAG_OFFLOAD``, default ``"auto"``: hardware tag matching on capable
        mlx5 devices (ConnectX-5 and later); ``True`` fails when none is present.
    devices : list of str or str, optional
        ``UCXCOMM_DEVICES``: UCX network devices to use (``"mlx5_0:1"``).

    Raises
    ------
    BootstrapError
        Missing/malformed launcher variables, refused token, unreachable store.
    CommTimeoutError
        The world did not form within ``timeout``.
    UnsupportedError
        ``transport="rdma"`` or ``tag_offload=True`` where that is not available, or the
        UCX that ``UCXCOMM_UCX`` names is missing, does not load or is older than 1.19.
    ValueError
        An unknown ``transport`` or malformed ``tag_offload`` (argument or variable), or
        a ``UCXCOMM_UCX`` that names no UCX (docs/transports.md).
    """
    from ..transport.config import policy_from
    from ..transport.library import requested

    check_timeout(timeout, "init", zero=False)
    policy = policy_from(transport, tag_offload, devices)  # ValueError at the call
    requested()  # UCXCOMM_UCX: ValueError at the call too
    return _Init(dict(rank=rank, size=size, store=store, timeout=timeout,
                      ucx_config=ucx_config, policy=policy))


async def _init(*, rank: int | None, size: int | None, store: str | None,
                timeout: float | None, ucx_config: dict[str, str] | None,
                policy: Any) -> Comm:
    global _world, _lock
    if _world is not None and not _world.closed:
        return _world.comm
    if _lock is None:
        _lock = asyncio.Lock()
    async with _lock:
        if _world is not None and not _world.closed:
            return _world.comm
        spec = detect(rank=rank, size=size, store=store)
        if timeout is None:
            timeout = settings.get("UCXCOMM_TIMEOUT")
        _world = await _form_world(spec, timeout, ucx_config, policy)
        return _world.comm


async def finalize() -> None:
    """Close the world communicator (collective); a later :func:`init` starts anew."""
    global _world, _lock
    world, _world, _lock = _world, None, None
    if world is not None:
        await world.comm.close()


def _abort() -> None:
    global _world, _lock
    world, _world, _lock = _world, None, None
    if world is not None:
        world.comm.abort()
